"""Model parallelism, the study's split: encoder on one device, decoder + head on another.

Memory / compute trade-off: each device holds only its half's parameters, gradients,
optimizer state and activations (the encoder's stages on one, the decoder's full-resolution
blocks on the other), so per-device memory drops to roughly half (the study: 39 % of the
total at 512 px). The skip features cross devices in forward and their gradients in
backward; only one device computes at a time, so a step takes at least as long as on one
GPU plus the transfers (the study: +14 % per epoch over one GPU).

mode=local: one process, two GPUs of a host; features move with `.to()`.
mode=process: two processes (world_size 2, e.g. one GPU per host, as in the study); rank 0
runs the encoder, rank 1 the decoder and the loss; features and their gradients travel by
torch.distributed send/recv. Each rank keeps a plain optimizer for its half, so a
learning-rate scheduler (option `scheduler`) works, which the study could not use.
With amp:fp16 the two ranks' GradScalers skip overflowing steps together.
"""
from __future__ import annotations

import torch

from memstudy.distributed import context, p2p
from memstudy.lr_schedule import add_scheduler, total_steps
from memstudy.techniques.mp.split import (DecoderHalf, EncoderHalf, LocalSplitUNet, P2PHalf,
                                          check_split_size)
from memstudy.errors import ConfigError
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import MpOptions as Options


def check(opts: Options, plan: Plan) -> None:
    if opts.scheduler != "none":
        total_steps(plan.config)  # refuses a schedule whose length cannot be known
    if opts.mode == "local":
        _check_local(plan)
        return
    check_split_size(plan, "mp", alternative="mp:mode=local (one process, pads and crops)")
    context.check_world(plan, "mp", exact=2)
    context.resolve_backend(opts.backend, plan.device, "mp", gloo_on_cuda=False)


def _check_local(plan: Plan) -> None:
    first = plan.device.index or 0
    if plan.device.type != "cuda" or plan.n_gpus < first + 2:
        raise ConfigError(f"mp:mode=local places encoder and decoder on two GPUs of this "
                          f"process but {plan.n_gpus} GPU(s) are usable from {plan.device}; "
                          "use mp:mode=process with world_size = 2 (one device per process)")
    if plan.config.world_size != 1:
        raise ConfigError("mp:mode=local runs in one process: set world_size = 1, or use "
                          "mp:mode=process")


def apply(opts: Options, build: Build) -> None:
    if opts.mode == "local":
        first = build.device.index or 0
        devices = (torch.device("cuda", first), torch.device("cuda", first + 1))
        build.model = LocalSplitUNet(build.model, *devices)
        build.placed = True
        build.runtime.input_device, build.runtime.output_device = devices
        build.notes["mp"] = {"mode": "local", "devices": [str(d) for d in devices]}
    else:
        apply_process_split(build, "mp")
    add_scheduler(opts.scheduler, build)


def apply_process_split(build: Build, owner: str) -> int:
    """Keep this rank's half (rank 0: encoder, rank 1: decoder + head + loss)."""
    r = context.rank()
    if context.world_size() != 2:
        raise RuntimeError(f"{owner}: process group has {context.world_size()} ranks, needs 2")
    half = EncoderHalf(build.model) if r == 0 else DecoderHalf(build.model)
    build.model = P2PHalf(half, rank=r, peer=1 - r)
    build.runtime.rank = r
    build.runtime.loss_fn = _split_loss(build, r)
    build.notes[owner] = {"mode": "process", "half": "encoder" if r == 0 else "decoder"}
    return r


def _split_loss(build: Build, r: int):
    """Rank 1 computes the loss and sends its value; rank 0's loss is token + that value, so
    both ranks log the same loss and rank 0's backward starts from the token."""
    base, runtime = build.runtime.loss_fn, build.runtime

    def encoder_loss(token: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
        if runtime.scaler is not None:
            p2p.synchronise_overflow(runtime.scaler)
        return token + p2p.recv_value(1, token.device)

    def decoder_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if runtime.scaler is not None:
            p2p.synchronise_overflow(runtime.scaler)
        loss = base(out, target)
        p2p.send_value(loss, 0)
        return loss

    return encoder_loss if r == 0 else decoder_loss


def _owns_group(opts: Options) -> bool:
    return opts.mode == "process"  # mode=local runs in one process on two GPUs


def _gpus_per_process(opts: Options) -> int:
    return 2 if opts.mode == "local" else 1


def _sets_learning_rate(opts: Options) -> str | bool:
    return opts.scheduler != "none" and f"sets the learning rate with mp:scheduler={opts.scheduler}"


register(Technique("mp", Stage.STRUCTURE, Options,
                   "model parallel: encoder and decoder on two devices (one process or two)",
                   apply, check, order=90, owns_process_group=_owns_group,
                   gpus_per_process=_gpus_per_process, splits_model=True, splits_gradients=True,
                   sets_learning_rate=_sets_learning_rate,
                   needs_unet="splits the U-Net into its encoder and its decoder + head"))
