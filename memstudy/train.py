"""The training loop, written as explicit phases: forward, backward, step, validation.

Batches are drawn with the runtime's current batch size, so a controller may change it
between steps. Warm-up steps run unmeasured; the next `measure_steps` are measured phase by
phase; the rest are plain: timed as a whole, with no meter (their time is `step_time_s`).

Gradient accumulation (`runtime.micro_batches` = k, the `accumulate` technique): a step is one
*optimizer* step. It draws k micro-batches of `batch_size` images (consecutive in the epoch's
order, so together they are exactly the images a k-times larger batch would take), runs a
`forward` and a `backward` phase per micro-batch (each loss scaled by its share of the step's
images, 1/k for equal micro-batches: [Compute-Opt] eq. 4, docs/references.md) and one `step` phase. Warm-up,
measured steps, `max_steps` and the step series all count optimizer steps. With k > 1 the
micro-batches wait on the host and each is copied to the device just before its forward, so
only one micro-batch of inputs is on the device at a time; the copy is part of the step's
time (outside every phase). With k = 1 the batch is on the device before the step, as always.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from memstudy.errors import ConfigError, Diverged, PhaseFailure
from memstudy.meters import PhaseRecorder, alloc_retries
from memstudy.meters.profile import step_profile
from memstudy.quality import SegmentFigures, quality
from memstudy.runtime import MicroBatch, StepInfo
from memstudy.techniques import micro_batches, parse_techniques, planned_steps
from memstudy.techniques.base import Build
from memstudy.tiling.validation import validation_forward


def _record_alloc_retries(state: "TrainState", rank: int, device: torch.device) -> None:
    """The step's allocator retries (each a slow step: meters.alloc_retries)."""
    total = alloc_retries(device)
    state.series.append((rank, state.step, "alloc_retries", total - state.alloc_retries))
    state.alloc_retries = total


@dataclass
class TrainState:
    """What the loop has produced so far; kept even when a phase fails."""
    step: int = 0
    epoch: int = 0
    epochs: list[dict] = field(default_factory=list)
    series: list[tuple[int, int, str, float]] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    oom_retries: int = 0
    alloc_retries: int = 0  # the CUDA allocator's num_alloc_retries after the last step
    started: float | None = None  # perf_counter when the first training step began
    # (seconds since `started`, optimizer steps) when validation first reached
    # train.target_val_loss; None while it has not
    target_reached: tuple[float, int] | None = None
    energy_j: float | None = None  # GPU energy of the training loop (NVML), set by the runner


def make_batch(dataset, indices: list[int], device: torch.device,
               memory_format: torch.memory_format = torch.contiguous_format
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The images `indices` of `dataset` as one batch on `device` (in `memory_format`:
    channels_last when train.channels_last is on, to match the model's weights)."""
    return to_device(host_batch(dataset, indices, device), device, memory_format)


def host_batch(dataset, indices: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The images and targets stacked on the host (pinned when they will go to a GPU)."""
    items = [dataset[i] for i in indices]
    x = torch.stack([it[0] for it in items])
    y = torch.stack([it[1] for it in items])
    if device.type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
    return x, y


def to_device(batch: tuple[torch.Tensor, torch.Tensor], device: torch.device,
              memory_format: torch.memory_format) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = (t.to(device, non_blocking=True) for t in batch)
    return x.contiguous(memory_format=memory_format), y.contiguous(memory_format=memory_format)


def batches_device(rt, in_device: torch.device) -> torch.device:
    """Where a step's batches go: the input device, or host memory (pinned for a GPU by
    host_batch) where the tiled regions and the chunked loss read them by strips
    (tile:stream, Runtime.inputs_on_host)."""
    return torch.device("cpu") if rt.inputs_on_host else in_device


def input_format(cfg) -> torch.memory_format:
    """The memory format of batches: channels_last when train.channels_last is on."""
    return torch.channels_last if cfg.channels_last else torch.contiguous_format


def train(build: Build, train_set, val_set, recorder: PhaseRecorder, state: TrainState,
          progress: Callable[[str], None] | None = None) -> TrainState:
    cfg, model, rt = build.config.train, build.model, build.runtime
    state.optimizer = optimizer = rt.optimizer_factory(model)
    in_device = rt.input_device or build.device
    batch_device = batches_device(rt, in_device)
    first_measured, last_measured = cfg.warmup_steps, cfg.warmup_steps + cfg.measure_steps
    total = cfg.max_steps or math.inf
    state.started = time.perf_counter()
    state.alloc_retries = recorder.retries_before_run  # earlier runs' in this process are not this run's
    for epoch in range(cfg.epochs):
        state.epoch = epoch
        model.train()
        t0, losses, pos = time.perf_counter(), [], 0
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(cfg.seed + epoch))
        while pos < len(order) and state.step < total:
            pieces = _step_pieces(order, pos, rt)
            if not pieces:
                break
            parts = [piece[rt.shard[0]::rt.shard[1]].tolist() for piece in pieces]
            batches = [host_batch(train_set, indices, in_device) for indices in parts]
            if len(batches) == 1:  # no accumulation: on the device before the step, as ever
                batches = [to_device(batches[0], batch_device, input_format(cfg))]
            measured = first_measured <= state.step < last_measured
            recorder.in_warmup = state.step < first_measured
            # the last warm-up step, after the first (autotuning, graph capture): never measured
            profiled = (build.config.meter.profile and build.device.type == "cuda"
                        and first_measured >= 2 and state.step == first_measured - 1)
            try:
                with step_profile(state.series, rt.rank, build.device) if profiled \
                        else contextlib.nullcontext():
                    loss = _train_step(model, rt, optimizer, recorder, state, batches,
                                       (batch_device, input_format(cfg)), measured)
            except PhaseFailure as failure:
                if not _retry_after_oom(failure, rt, optimizer, state):
                    raise
                recorder.discard_failed_step()  # the retry's figures replace the failed try's
                continue
            pos += sum(len(piece) for piece in pieces)
            state.step += 1
            losses.append(loss)
            state.series.append((rt.rank, state.step, "loss", loss))
            state.series.append((rt.rank, state.step, "batch_size", len(parts[0])))
            if len(parts) > 1 or rt.micro_batches > 1:
                state.series.append((rt.rank, state.step, "micro_batches", len(parts)))
            if build.device.type == "cuda":
                _record_alloc_retries(state, rt.rank, build.device)
            info = StepInfo(step=state.step, epoch=epoch, loss=loss,
                            batch_size=sum(len(indices) for indices in parts),
                            optimizer=optimizer, micro_batches=len(parts))
            for hook in rt.step_hooks:
                hook(info)
            if progress and (state.step % 10 == 0 or state.step == 1):
                progress(f"epoch {epoch + 1}/{cfg.epochs} step {state.step} loss {loss:.4f}")
        record = {"rank": rt.rank, "epoch": epoch, "steps": state.step,
                  "train_loss": sum(losses) / len(losses) if losses else None,
                  "time_s": time.perf_counter() - t0}
        if cfg.validate:
            record.update(validate(build, val_set, recorder, state.step))
            _check_target(record["val_loss"], cfg.target_val_loss, state)
        state.epochs.append(record)
        recorder.look_at_gpu()  # a process that shared the GPU this epoch (its time is not ours)
        if progress:
            progress(_epoch_line(record, cfg.epochs))
        if state.step >= total:
            break
    return state


def _check_target(val_loss: float, target: float | None, state: TrainState) -> None:
    """Time to target: wall time from the first training step until the end of the first
    validation pass whose loss is at or below train.target_val_loss."""
    if target is not None and state.target_reached is None and val_loss <= target:
        state.target_reached = (time.perf_counter() - state.started, state.step)


def check_measurable(config, train_images: int, chosen: dict | None = None) -> None:
    """Refuse a run whose warm-up takes every step: it would record no phase figures.

    Fewer steps than warm-up + measure_steps is allowed: the steps after warm-up are all measured
    (a large measure_steps means "measure every step"). `chosen`: config.techniques parsed,
    where the caller has them (the plan's)."""
    cfg = config.train
    chosen = parse_techniques(config.techniques) if chosen is None else chosen
    # adaptive accumulation may take its largest k: count the fewest steps the run can take
    steps = planned_steps(config, train_images, most_micro_batches=True, chosen=chosen)
    if steps <= cfg.warmup_steps:
        accumulation = _accumulation(config, chosen)
        raise ConfigError(
            f"this run takes {steps} optimizer step(s) ({cfg.epochs} epoch(s) of {train_images} "
            f"training images at batch {cfg.batch_size}{_cap(cfg)}{accumulation}) and "
            f"train.warmup_steps = {cfg.warmup_steps} leaves none to measure: raise train.epochs "
            "or data.train_images, or lower train.warmup_steps")


def _cap(cfg) -> str:
    return f", train.max_steps = {cfg.max_steps}" if cfg.max_steps else ""


def _accumulation(config, chosen: dict) -> str:
    k = micro_batches(config.techniques, most=True, chosen=chosen)
    return f", {k} micro-batches per step" if k > 1 else ""


def _step_pieces(order: torch.Tensor, pos: int, rt) -> list[torch.Tensor]:
    """The next optimizer step's global micro-batches: up to `micro_batches` pieces of
    batch_size * ranks images. Data parallel ranks take interleaved shards of each piece (as
    DistributedSampler does), and an incomplete last piece is dropped so every rank steps."""
    size, count = rt.batch_size * rt.shard[1], rt.shard[1]
    pieces = list(order[pos:pos + size * rt.micro_batches].split(size))
    if count > 1 and pieces and len(pieces[-1]) < size:
        pieces.pop()
    return pieces


def _train_step(model, rt, optimizer, recorder, state, batches, placement, measured) -> float:
    """One optimizer step over the micro-batches `batches` (one without accumulation).

    The loss is read (`.item()`, a host sync) once, after the optimizer step, as a hand-written
    loop that logs its loss does: reading it between phases would stall the GPU while the CPU
    launches the next phase. A non-finite loss is still reported in the phase that produced it.
    The step's loss is the micro-batch losses weighted by their share of the step's images."""
    phase = "forward"
    try:
        with recorder.step(measured):
            if rt.forward_backward is not None:  # a pipeline schedule: one fused phase
                phase = "forward_backward"
                (x, y), = batches  # accumulate refuses pipeline: always one micro-batch
                with recorder.phase(phase):
                    loss = rt.forward_backward(model, x, y)
            else:
                images, loss = sum(len(b[0]) for b in batches), 0.0
                for index, batch in enumerate(batches):
                    x, y = to_device(batch, *placement) if len(batches) > 1 else batch
                    micro = MicroBatch(state.step + 1, index, len(batches), len(x), len(x) / images)
                    # DDP: all-reduce only in the last micro-batch's backward (the gradients
                    # are summed locally before it, so the reduced result is the same)
                    last = index == len(batches) - 1
                    quiet = hasattr(model, "no_sync") and not last
                    with model.no_sync() if quiet else contextlib.nullcontext():
                        phase = "forward"
                        with recorder.phase("forward"):
                            part = rt.forward(model, x, y)
                        phase = "backward"
                        with recorder.phase("backward"):
                            rt.backward(part if micro.weight == 1 else part * micro.weight)
                            for hook in rt.micro_batch_hooks:
                                hook(micro)
                    del x, y
                    # the graph is gone; keep only the value
                    loss = part.detach() if micro.weight == 1 else loss + part.detach() * micro.weight
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
    val_set.load()  # the images drawn or read before the phase: its figures are the model's
    try:
        with recorder.step(measured=first, timed=False), recorder.phase("validation"):
            float32 = build.config.train.val_precision == "float32"
            result = _evaluate(build, val_set, float32=float32)
    except Exception as exc:  # an OOM in validation is recorded as validation's, not setup's
        raise PhaseFailure("validation", step, exc) from exc
    if not math.isfinite(result["val_loss"]):
        raise Diverged("validation", step, result["val_loss"], _float32_hint(build, val_set))
    return result


def _evaluate(build: Build, val_set, float32: bool = False) -> dict[str, float]:
    """Validation figures over `val_set`; `float32`: the forward in float32 (autocast off and
    the techniques' float32 contexts), else in the run's own precision. Enhancement: loss,
    SSIM, PSNR (per-image means); segmentation: loss, Dice, IoU (pixel counts of the set)."""
    model, rt, cfg = build.model, build.runtime, build.config.train
    in_device = rt.input_device or build.device
    sums: dict[str, float] = {}
    segment = SegmentFigures(build.config.model.classes) if cfg.task == "segment" else None
    model.eval()
    try:
        for i in range(0, len(val_set), cfg.batch_size):
            x, y = to_device(host_batch(val_set, list(range(i, min(i + cfg.batch_size,
                                                                   len(val_set)))), in_device),
                             batches_device(rt, in_device), input_format(cfg))
            with rt.forward_context(), _float32_forward(rt, in_device, float32):
                # exact tiled eval forward (train.val_tile_rows; 0 = untiled), recorded in notes
                out, build.notes["val_tiling"] = validation_forward(model, x, cfg.val_tile_rows)
            # a target in host memory (tile:stream) is read by blocks, never whole on the device
            y = y if rt.inputs_on_host else y.to(out.device)
            if segment is not None:
                segment.add(out, y)
                continue
            for k, v in quality(out, y, cfg.msssim_scales).items():
                sums[k] = sums.get(k, 0.0) + v * len(x)
    finally:
        model.train()
    if segment is not None:
        return {f"val_{k}": v for k, v in segment.result().items()}
    return {f"val_{k}": v / len(val_set) for k, v in sums.items()}


def _float32_forward(rt, device: torch.device, on: bool) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    if on:  # enabled=True would *set* autocast (default dtype), so only ever pass False
        stack.enter_context(torch.autocast(device.type, enabled=False))
        for make in rt.float32_contexts:
            stack.enter_context(make())
    return stack


def _float32_hint(build: Build, val_set) -> str | None:
    """Tell weights that diverged from a float16 eval forward that overflowed.

    Early in training, BatchNorm's running statistics lag the batch statistics (momentum 0.1,
    and the encoder starts from ImageNet's), so eval-mode activations can be ~3000x their
    training-mode size; in float16 (max 65504) that overflows at large images although the
    weights are finite and train. Re-evaluating the same weights in float32 tells the two apart.
    """
    # amp:fp16 (its note), tri_accel's FP16 units (they bring a loss scaler)
    float16 = (build.notes.get("autocast_dtype") == str(torch.float16)
               or build.runtime.scaler is not None)
    if not float16 or build.config.train.val_precision == "float32":
        return None
    loss = _evaluate(build, val_set, float32=True)["val_loss"]
    if not math.isfinite(loss):
        return None
    return (f"the same weights validate to {loss:.4f} in float32, so the float16 eval forward "
            "overflowed (BatchNorm running statistics not yet settled: train more steps before "
            "validating, validate in float32 with train.val_precision = float32, or use bf16)")


def _epoch_line(r: dict, epochs: int) -> str:
    parts = [f"epoch {r['epoch'] + 1}/{epochs}", f"{r['time_s']:.1f} s"]
    if r.get("train_loss") is not None:
        parts.append(f"train loss {r['train_loss']:.4f}")
    if "val_dice" in r:
        parts.append(f"val loss {r['val_loss']:.4f} Dice {r['val_dice']:.4f} IoU {r['val_iou']:.4f}")
    elif "val_loss" in r:
        parts.append(f"val loss {r['val_loss']:.4f} SSIM {r['val_ssim']:.4f} PSNR {r['val_psnr']:.2f} dB")
    return " | ".join(parts)
