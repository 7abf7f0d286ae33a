"""Pipeline parallelism: the mp split run over micro-batches (torch.distributed.pipelining).

Memory / compute trade-off: as mp, each of the two ranks holds one half (rank 0 the encoder,
rank 1 the decoder, head and loss). The batch is cut into `micro_batches` pieces so both
ranks compute at once (rank 0 on micro-batch k+1 while rank 1 works on k): less idle time
than mp at the price of per-micro-batch transfers. GPipe runs all forwards then all
backwards (activations of every micro-batch alive at once); 1F1B interleaves them and
keeps at most two micro-batches' activations per rank. Forward and backward are one
schedule call, measured as one phase, `forward_backward`.

Equality with the unsplit model holds micro-batch by micro-batch: batch norm normalises
over each micro-batch, so a pipelined step equals gradient accumulation over the same
micro-batches on one device.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from memstudy.distributed import context, p2p
from memstudy.techniques.mp.split import check_split_size
from memstudy.lr_schedule import add_scheduler, total_steps
from memstudy.errors import ConfigError
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import PipelineOptions as Options
from memstudy.techniques.mp import apply_process_split

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def check(opts: Options, plan: Plan) -> None:
    if opts.micro_batches < 2:
        raise ConfigError(f"pipeline:micro_batches must be >= 2, the number of stages (got "
                          f"{opts.micro_batches}); for one micro-batch use mp")
    b = plan.config.train.batch_size
    if b % opts.micro_batches:
        raise ConfigError(f"pipeline:micro_batches={opts.micro_batches} must divide "
                          f"train.batch_size {b}; change either")
    check_split_size(plan, "pipeline")
    context.check_world(plan, "pipeline", exact=2)
    context.resolve_backend(opts.backend, plan.device, "pipeline", gloo_on_cuda=False)
    if opts.scheduler != "none":
        total_steps(plan.config)


def apply(opts: Options, build: Build) -> None:
    base_loss = build.runtime.loss_fn  # the split replaces it with the mp wrappers
    r = apply_process_split(build, "pipeline")
    build.notes["pipeline"] = {"micro_batches": opts.micro_batches, "schedule": opts.schedule}
    build.runtime.forward_backward = PipelinedStep(build, opts, r, base_loss)
    add_scheduler(opts.scheduler, build)


class PipelinedStep:
    """forward + backward of one step through the schedule; returns the (unscaled) loss.

    The stage is built at the first step, once the half is on its device and wrapped by
    later techniques (checkpointing)."""

    def __init__(self, build: Build, opts: Options, r: int, base_loss):
        self.build, self.opts, self.rank, self.base_loss = build, opts, r, base_loss
        self.schedule = None
        self.losses: list[torch.Tensor] = []

    def _make(self, device: torch.device):
        half = self.build.model.part
        stage = PipelineStage(half, self.rank, 2, device)
        # every rank passes the loss: a schedule without one runs no backward (only the last
        # stage calls it)
        return SCHEDULES[self.opts.schedule](stage, self.opts.micro_batches, loss_fn=self._loss)

    def _loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.base_loss(out, target)
        self.losses.append(loss.detach())
        scaler = self.build.runtime.scaler
        return scaler.scale(loss) if scaler is not None else loss

    def __call__(self, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rt = self.build.runtime
        device = next(model.parameters()).device
        if self.schedule is None:
            self.schedule = self._make(device)
        if rt.scaler is not None:
            p2p.synchronise_overflow(rt.scaler)
            if self.rank == 0:  # rank 0 computes no loss, but its scaler must be initialised
                rt.scaler.scale(torch.zeros((), device=device))  # to unscale and step
        self.losses = []
        with rt.forward_context():
            if self.rank == 0:
                self.schedule.step(x)
            else:
                self.schedule.step(target=y.to(device))
        # the schedule's first step also calls the loss once while inferring shapes: keep
        # the micro-batches' losses only
        value = (torch.stack(self.losses[-self.opts.micro_batches:]).mean().float()
                 if self.rank == 1
                 else torch.zeros((), device=device))
        dist.broadcast(value, src=1)  # both ranks record the step's loss
        return value


def _sets_learning_rate(opts: Options) -> str | bool:
    return (opts.scheduler != "none"
            and f"sets the learning rate with pipeline:scheduler={opts.scheduler}")


register(Technique("pipeline", Stage.STRUCTURE, Options,
                   "pipeline: the mp split over micro-batches (GPipe / 1F1B), two ranks",
                   apply, check, order=90, owns_process_group=True, splits_model=True,
                   splits_gradients=True, sets_learning_rate=_sets_learning_rate,
                   needs_unet="splits the U-Net into its encoder and its decoder + head"))
