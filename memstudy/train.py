"""The training loop, written as explicit phases: forward, backward, step, validation.

Batches are drawn with the runtime's current batch size, so a controller may change it
between steps. Warm-up steps run unmeasured; the next `measure_steps` are measured phase by
phase; the rest are plain: timed as a whole, with no meter (their time is `step_time_s`).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from memstudy.errors import ConfigError, Diverged, PhaseFailure
from memstudy.meters import PhaseRecorder
from memstudy.quality import quality
from memstudy.runtime import StepInfo
from memstudy.techniques import shards_batch
from memstudy.techniques.base import Build


@dataclass
class TrainState:
    """What the loop has produced so far; kept even when a phase fails."""
    step: int = 0
    epoch: int = 0
    epochs: list[dict] = field(default_factory=list)
    series: list[tuple[int, int, str, float]] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    oom_retries: int = 0


def make_batch(dataset, indices: list[int], device: torch.device,
               memory_format: torch.memory_format = torch.contiguous_format
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The images `indices` of `dataset` as one batch on `device` (in `memory_format`:
    channels_last when train.channels_last is on, to match the model's weights)."""
    items = [dataset[i] for i in indices]
    x = torch.stack([it[0] for it in items])
    y = torch.stack([it[1] for it in items])
    if device.type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x.contiguous(memory_format=memory_format), y.contiguous(memory_format=memory_format)


def input_format(cfg) -> torch.memory_format:
    """The memory format of batches: channels_last when train.channels_last is on."""
    return torch.channels_last if cfg.channels_last else torch.contiguous_format


def train(build: Build, train_set, val_set, recorder: PhaseRecorder, state: TrainState,
          progress: Callable[[str], None] | None = None) -> TrainState:
    cfg, model, rt = build.config.train, build.model, build.runtime
    state.optimizer = optimizer = rt.optimizer_factory(model)
    in_device = rt.input_device or build.device
    first_measured, last_measured = cfg.warmup_steps, cfg.warmup_steps + cfg.measure_steps
    total = cfg.max_steps or math.inf
    for epoch in range(cfg.epochs):
        state.epoch = epoch
        model.train()
        t0, losses, pos = time.perf_counter(), [], 0
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(cfg.seed + epoch))
        while pos < len(order) and state.step < total:
            chunk = _global_batch(order, pos, rt)
            if chunk is None:
                break
            indices = chunk[rt.shard[0]::rt.shard[1]].tolist()
            x, y = make_batch(train_set, indices, in_device, input_format(cfg))
            measured = first_measured <= state.step < last_measured
            recorder.in_warmup = state.step < first_measured
            try:
                loss = _train_step(model, rt, optimizer, recorder, state, x, y, measured)
            except PhaseFailure as failure:
                if not _retry_after_oom(failure, rt, optimizer, state):
                    raise
                continue
            pos += len(chunk)
            state.step += 1
            losses.append(loss)
            state.series.append((rt.rank, state.step, "loss", loss))
            state.series.append((rt.rank, state.step, "batch_size", len(indices)))
            info = StepInfo(step=state.step, epoch=epoch, loss=loss, batch_size=len(indices),
                            optimizer=optimizer)
            for hook in rt.step_hooks:
                hook(info)
            if progress and (state.step % 10 == 0 or state.step == 1):
                progress(f"epoch {epoch + 1}/{cfg.epochs} step {state.step} loss {loss:.4f}")
        record = {"rank": rt.rank, "epoch": epoch, "steps": state.step,
                  "train_loss": sum(losses) / len(losses) if losses else None,
                  "time_s": time.perf_counter() - t0}
        if cfg.validate:
            record.update(validate(build, val_set, recorder, state.step))
        state.epochs.append(record)
        if progress:
            progress(_epoch_line(record, cfg.epochs))
        if state.step >= total:
            break
    return state


def planned_steps(config, train_images: int) -> int:
    """Optimizer steps the run will take (at its initial batch size; an elastic batch takes fewer)."""
    cfg = config.train
    if shards_batch(config.techniques):  # declared by the technique (context.shard_batch):
        # data-parallel ranks drop an incomplete last global batch
        per_epoch = train_images // cfg.batch_size
    else:
        per_epoch = math.ceil(train_images / cfg.batch_size)
    return min(cfg.epochs * per_epoch, cfg.max_steps or math.inf)


def check_measurable(config, train_images: int) -> None:
    """Refuse a run whose warm-up takes every step: it would record no phase figures.

    Fewer steps than warm-up + measure_steps is allowed: the steps after warm-up are all measured
    (a large measure_steps means "measure every step")."""
    cfg = config.train
    steps = planned_steps(config, train_images)
    if steps <= cfg.warmup_steps:
        raise ConfigError(
            f"this run takes {steps} optimizer step(s) ({cfg.epochs} epoch(s) of {train_images} "
            f"training images at batch {cfg.batch_size}{_cap(cfg)}) and train.warmup_steps = "
            f"{cfg.warmup_steps} leaves none to measure: raise train.epochs or "
            "data.train_images, or lower train.warmup_steps")


def _cap(cfg) -> str:
    return f", train.max_steps = {cfg.max_steps}" if cfg.max_steps else ""


def _global_batch(order: torch.Tensor, pos: int, rt) -> torch.Tensor | None:
    """The next global batch; data parallel ranks take interleaved shards of it (as
    DistributedSampler does), and an incomplete last one is dropped so every rank steps."""
    count = rt.shard[1]
    chunk = order[pos:pos + rt.batch_size * count]
    return None if count > 1 and len(chunk) < rt.batch_size * count else chunk


def _train_step(model, rt, optimizer, recorder, state, x, y, measured) -> float:
    """One step. The loss is read (`.item()`, a host sync) once, after the optimizer step, as
    a hand-written loop that logs its loss does: reading it between phases would stall the
    GPU while the CPU launches the next phase. A non-finite loss is still reported in the
    phase that produced it."""
    phase = "forward"
    try:
        with recorder.step(measured):
            if rt.forward_backward is not None:  # a pipeline schedule: one fused phase
                phase = "forward_backward"
                with recorder.phase(phase):
                    loss = rt.forward_backward(model, x, y)
            else:
                with recorder.phase("forward"):
                    loss = rt.forward(model, x, y)
                phase = "backward"
                with recorder.phase("backward"):
                    rt.backward(loss)
                loss = loss.detach()  # the graph is gone; keep only the value
            phase = "step"
            with recorder.phase("step"):
                rt.step(optimizer)
            value = loss.item()
    except (Diverged, PhaseFailure):
        raise
    except Exception as exc:  # any failure is reported with the phase it happened in
        raise PhaseFailure(phase, state.step + 1, exc) from exc
    if not math.isfinite(value):
        raise Diverged("forward_backward" if rt.forward_backward is not None else "forward",
                       state.step + 1, value)
    return value


def _retry_after_oom(failure: PhaseFailure, rt, optimizer, state: TrainState) -> bool:
    if not isinstance(failure.cause, torch.OutOfMemoryError) or rt.oom_handler is None:
        return False
    optimizer.zero_grad(set_to_none=True)
    if rt.device.type == "cuda":
        torch.cuda.empty_cache()
    if not rt.oom_handler(failure.cause):
        return False
    state.oom_retries += 1
    # one row per step: a second retry of the same step replaces the first (primary key)
    state.series[:] = [r for r in state.series if r[1:3] != (state.step, "oom_retry")]
    state.series.append((rt.rank, state.step, "oom_retry", rt.batch_size))
    return True


@torch.no_grad()
def validate(build: Build, val_set, recorder: PhaseRecorder, step: int = 0) -> dict[str, float]:
    first = "validation" not in recorder.measured
    with recorder.step(measured=first, timed=False), recorder.phase("validation"):
        result = _evaluate(build, val_set)
    if not math.isfinite(result["val_loss"]):
        raise Diverged("validation", step, result["val_loss"], _float32_hint(build, val_set))
    return result


def _evaluate(build: Build, val_set, autocast: bool = True) -> dict[str, float]:
    model, rt, cfg = build.model, build.runtime, build.config.train
    in_device = rt.input_device or build.device
    sums: dict[str, float] = {}
    model.eval()
    try:
        for i in range(0, len(val_set), cfg.batch_size):
            x, y = make_batch(val_set, list(range(i, min(i + cfg.batch_size, len(val_set)))),
                              in_device, input_format(cfg))
            # enabled=True would *set* autocast (default dtype), so only ever pass False
            off = contextlib.nullcontext() if autocast else torch.autocast(in_device.type, enabled=False)
            with rt.forward_context(), off:
                out = model(x)
            for k, v in quality(out, y.to(out.device), cfg.msssim_scales).items():
                sums[k] = sums.get(k, 0.0) + v * len(x)
    finally:
        model.train()
    return {f"val_{k}": v / len(val_set) for k, v in sums.items()}


def _float32_hint(build: Build, val_set) -> str | None:
    """Tell weights that diverged from a float16 eval forward that overflowed.

    Early in training, BatchNorm's running statistics lag the batch statistics (momentum 0.1,
    and the encoder starts from ImageNet's), so eval-mode activations can be ~3000x their
    training-mode size; in float16 (max 65504) that overflows at large images although the
    weights are finite and train. Re-evaluating the same weights in float32 tells the two apart.
    """
    if build.notes.get("autocast_dtype") != str(torch.float16):
        return None
    loss = _evaluate(build, val_set, autocast=False)["val_loss"]
    if not math.isfinite(loss):
        return None
    return (f"the same weights validate to {loss:.4f} in float32, so the float16 eval forward "
            "overflowed (BatchNorm running statistics not yet settled: train more steps before "
            "validating, or use amp:bf16)")


def _epoch_line(r: dict, epochs: int) -> str:
    parts = [f"epoch {r['epoch'] + 1}/{epochs}", f"{r['time_s']:.1f} s"]
    if r.get("train_loss") is not None:
        parts.append(f"train loss {r['train_loss']:.4f}")
    if "val_loss" in r:
        parts.append(f"val loss {r['val_loss']:.4f} SSIM {r['val_ssim']:.4f} PSNR {r['val_psnr']:.2f} dB")
    return " | ".join(parts)
