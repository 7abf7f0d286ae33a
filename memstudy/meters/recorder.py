"""Per-phase measurement of a training step: time, allocator, NVML, tensor meter, categories.

Phases are forward (model + loss), backward, step (optimizer step and zero_grad) and
validation. Memory is measured only on "measured" steps (after warm-up), which also turn on
the saved-tensor observer and, where enabled, the tensor meter; each of their phases is timed
with the device synchronised before each clock read. The other steps carry no meter at all:
a plain step is timed as a whole (one synchronisation at each end, as a hand-written loop
would time it), its phases are neither synchronised nor timed, and warm-up steps are not
timed except the first (`first_step_time_s`: cuDNN autotuning, torch.compile). Comparing
plain and measured steps gives the meters' own overhead. docs/metrics.md defines each figure.
"""
from __future__ import annotations

import resource
import statistics
import sys
import time
import weakref
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from memstudy.config import MeterConfig
from memstudy.meters.nvml import GpuNeighbours, NvmlSampler
from memstudy.meters.loss import LossMeter
from memstudy.meters.tensor import LiveTensorMeter, storage_key, unique_storage_bytes
from memstudy.phases import PHASES
from memstudy.runtime import Runtime

TIME_FIGURES = {"time_s"}


def alloc_retries(device: torch.device) -> int:
    """The CUDA caching allocator's retries so far (near a budget it synchronises the device,
    frees its cache and tries again), from its host-side counters: no device sync."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


class PhaseRecorder:
    def __init__(self, device: torch.device, model: nn.Module, runtime: Runtime,
                 optimizer: Callable[[], torch.optim.Optimizer | None], cfg: MeterConfig,
                 cpu_limit_bytes: int | None = None, single_process: bool = True):
        self.device, self.model, self.runtime, self.optimizer = device, model, runtime, optimizer
        self.cuda = device.type == "cuda"
        # the allocator counts retries per process: an earlier run's in the same one are not this run's
        self.retries_before_run = alloc_retries(device) if self.cuda else 0
        self.tensor_meter_on = cfg.tensor == "on" or (cfg.tensor == "auto" and not self.cuda)
        self.nvml = NvmlSampler(device, cfg.nvml_interval_ms / 1e3) if self.cuda and cfg.nvml else None
        # other processes on the GPU; not for a distributed run, whose own ranks may hold
        # contexts on each other's GPUs (`single_process`: the run is one process)
        self.neighbours = (GpuNeighbours.open(device) if self.cuda and cfg.nvml and single_process
                           else None)
        self.measured: dict[str, list[dict[str, float]]] = defaultdict(list)
        self.first_step_time: float | None = None  # the run's first training step, warm-up or not
        self.step_times: dict[bool, list[float]] = {True: [], False: []}  # by measured or not
        self.bookkeeping: list[float] = []  # seconds per measured step spent by the meters between phases
        self._step_id = 0
        self._measuring = False
        self.in_warmup = True  # set by the training loop; validation passes ignore it
        self._saved: dict[tuple[str, int], tuple[int, Any, torch.device]] = {}
        self._meter: LiveTensorMeter | None = None
        self.loss_meter = LossMeter(device, lambda: self._meter)  # the loss's own memory
        self._loss_saved: set[tuple[str, int]] = set()  # saved storages first seen in the loss
        # On the CPU a memory budget is enforced by a tensor meter that stays on for every step.
        self._budget_meter = (LiveTensorMeter(cpu_limit_bytes, self._persistent_bytes())
                              if cpu_limit_bytes is not None and not self.cuda else None)

    @property
    def budget_meter(self) -> LiveTensorMeter | None:
        """The tensor meter enforcing a CPU budget (on for every step), if there is one."""
        return self._budget_meter

    # -- step and phase contexts ----------------------------------------------------------
    @contextmanager
    def step(self, measured: bool, timed: bool = True) -> Iterator[None]:
        """One training step (or, with timed=False, a validation pass) whose phases are measured
        if `measured`; the tensor meter's baseline is the persistent state already alive."""
        with ExitStack() as stack:
            meter = self._budget_meter
            if measured and meter is None and self.tensor_meter_on:
                meter = LiveTensorMeter(baseline_bytes=self._persistent_bytes())
            if meter is not None:
                stack.enter_context(meter)
            self._meter = meter
            if measured:
                self.look_at_gpu()  # before the clock: not in the step's time
                self._saved = {}
                self.runtime.saved_tensor_observers.append(self._observe_saved)
                stack.callback(self.runtime.saved_tensor_observers.remove, self._observe_saved)
                self._loss_saved = set()
                self.runtime.loss_observers.append(self.loss_meter)
                stack.callback(self.runtime.loss_observers.remove, self.loss_meter)
            self._measuring = measured
            self._step_id += 1
            first = timed and self.first_step_time is None
            # warm-up steps (but the first) are not timed: no synchronisation at all
            clocked = measured or first or (timed and not self.in_warmup)
            if clocked:
                self._sync()
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._measuring = False
            if not clocked:
                return
            self._sync()
            wall = time.perf_counter() - t0
            if first:
                self.first_step_time = wall
            if timed and not self.in_warmup:
                if measured:  # the phases' own time; the meters' bookkeeping between them apart
                    inside = self._phase_time(self._step_id)
                    self.step_times[True].append(inside)
                    self.bookkeeping.append(wall - inside)
                else:
                    self.step_times[False].append(wall)

    def discard_failed_step(self) -> None:
        """Forget the phase records of the step that just failed and is about to be retried
        (an elastic batch shrinking after an out-of-memory error): the run's figures describe
        the steps that trained, not a try that did not fit (whose completed phases, e.g. a
        forward at the larger batch before backward ran out, would otherwise set the maxima)."""
        for phase in list(self.measured):
            kept = [r for r in self.measured[phase] if r.get("_step") != self._step_id]
            if kept:
                self.measured[phase] = kept
            else:
                del self.measured[phase]

    def _phase_time(self, step_id: int) -> float:
        """Seconds of all phases of one step: with gradient accumulation a step holds k
        forward and k backward phases (their records are the last ones of each phase)."""
        total = 0.0
        for recs in self.measured.values():
            for rec in reversed(recs):
                if rec.get("_step") != step_id:
                    break
                total += rec["time_s"]
        return total

    @contextmanager
    def phase(self, name: str, measure: bool | None = None) -> Iterator[None]:
        """A phase, timed and measured inside measured steps (or when `measure` says so);
        elsewhere it does nothing: plain steps are timed whole, without per-phase syncs."""
        measuring = self._measuring if measure is None else measure
        if not measuring:
            yield
            return
        rec: dict[str, float] = {}
        self._sync()
        self._before(rec)
        t0 = time.perf_counter()
        yield
        self._sync()
        rec["time_s"] = time.perf_counter() - t0
        rec["_step"] = self._step_id
        self._after(name, rec)
        self.measured[name].append(rec)

    def look_at_gpu(self) -> None:
        """Count the other processes on the GPU now (measured steps, epoch ends)."""
        if self.neighbours is not None:
            self.neighbours.look()

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()

    # -- measurement ------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _before(self, rec: dict[str, float]) -> None:
        if self.cuda:
            rec["alloc_start_bytes"] = torch.cuda.memory_allocated(self.device)
            self._retries_at_start = alloc_retries(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.nvml is not None:
            rec["nvml_start_bytes"] = self.nvml.phase_start()
        if self._meter is not None:
            self._meter.reset_peak()
            rec["tensor_start_bytes"] = self._meter.current
        self.loss_meter.phase_start()

    def _after(self, name: str, rec: dict[str, float]) -> None:
        if self.cuda:
            start = rec["alloc_start_bytes"]
            # the loss meter may have reset the counter mid-phase: it kept the peak before
            rec["alloc_peak_bytes"] = (self.loss_meter.phase_peak(
                torch.cuda.max_memory_allocated(self.device)) - start)
            rec["alloc_held_bytes"] = torch.cuda.memory_allocated(self.device) - start
            rec["reserved_peak_bytes"] = torch.cuda.max_memory_reserved(self.device)
            rec["alloc_retries"] = alloc_retries(self.device) - self._retries_at_start
        if self.nvml is not None:
            rec["nvml_peak_bytes"] = self.nvml.phase_end()
            rec["nvml_delta_bytes"] = rec["nvml_peak_bytes"] - rec["nvml_start_bytes"]
        if self._meter is not None:
            start = rec["tensor_start_bytes"]
            rec["tensor_peak_bytes"] = self._meter.peak - start
            rec["tensor_held_bytes"] = self._meter.current - start
        rec.update(self._categories())
        rec.update(self.loss_meter.figures)  # loss_peak_bytes, where the loss ran
        if name == "forward":
            rec["saved_bytes"] = rec["cat_saved_bytes"]
            rec["saved_host_bytes"] = self._saved_bytes(on_device=False)

    def _observe_saved(self, packed: Any) -> None:
        """Saved-tensor observer: remembers each distinct storage kept for backward."""
        if isinstance(packed, torch.Tensor):
            storage, key = packed.untyped_storage(), storage_key(packed)
            known = self._saved.get(key)
            if known is not None and known[1]() is not None:
                return  # a storage already remembered, still alive
            # new, or a freed storage's address reused (a block of the chunked loss saves and
            # frees tensors whose addresses its gradient maps then take): this storage's entry
            self._saved[key] = (storage.nbytes(), weakref.ref(storage), packed.device)
            if self.loss_meter.active:
                self._loss_saved.add(key)  # saved by the loss, not the model
            else:
                self._loss_saved.discard(key)

    def _saved_bytes(self, on_device: bool, of_loss: bool = False) -> int:
        """Live saved storages (parameters excluded) here or on the host, the model's or
        (of_loss) the loss's."""
        params = self._param_keys()
        total = 0
        for key, (nbytes, ref, device) in self._saved.items():
            here = device.type == self.device.type
            mine = (key in self._loss_saved) == of_loss
            if ref() is not None and key not in params and here == on_device and mine:
                total += nbytes
        return total

    def _param_keys(self) -> set[tuple[str, int]]:
        return {storage_key(t) for t in _param_tensors(self.model)}

    def _persistent_bytes(self) -> int:
        """Parameters, buffers, gradients and optimizer state alive now."""
        return unique_storage_bytes([*_param_tensors(self.model), *self._grads(), *self._opt_state()])

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def _opt_state(self) -> list[torch.Tensor]:
        opt = self.optimizer()
        return [v for s in (opt.state.values() if opt is not None else []) for v in s.values()
                if isinstance(v, torch.Tensor) and v.device.type == self.device.type]

    def _categories(self) -> dict[str, float]:
        """Live bytes at the end of the phase by category; 'other' is what none of them explain."""
        cats = {"cat_params_bytes": unique_storage_bytes(_param_tensors(self.model)),
                "cat_grads_bytes": unique_storage_bytes(self._grads()),
                "cat_optimizer_bytes": unique_storage_bytes(self._opt_state()),
                "cat_saved_bytes": self._saved_bytes(on_device=True),
                "cat_loss_saved_bytes": self._saved_bytes(on_device=True, of_loss=True)}
        live = (torch.cuda.memory_allocated(self.device) if self.cuda
                else self._meter.current if self._meter is not None else None)
        if live is not None:
            cats["cat_other_bytes"] = live - sum(cats.values())
        return cats

    # -- summary ------------------------------------------------------------------------------
    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase: memory figures as the maximum over measured steps, times as medians."""
        out: dict[str, dict[str, float]] = {}
        for phase, recs in self.measured.items():
            keys = [k for k in recs[0] if not k.startswith("_")]
            out[phase] = {k: (statistics.median if k in TIME_FIGURES else max)(r[k] for r in recs)
                          for k in keys}
            out[phase]["measured_steps"] = len(recs)
        out["run"] = self._step_summary()
        return out

    def _step_summary(self) -> dict[str, float]:
        """Step time unmetered (if any step ran without meters) and metered, and the overhead."""
        metered, plain = self.step_times[True], self.step_times[False]
        run: dict[str, float] = {}
        if metered:
            run["metered_step_time_s"] = statistics.median(metered)
        if plain:
            run["step_time_s"] = statistics.median(plain)
            # the spread a median hides: a handful of steps of a host-heavy set can differ
            # by a tenth (docs/techniques/tile.md)
            run["step_time_min_s"], run["step_time_max_s"] = min(plain), max(plain)
            run["plain_steps"] = len(plain)
        elif metered:
            run["step_time_s"] = run["metered_step_time_s"]
        if metered and plain:
            run["meter_overhead"] = run["metered_step_time_s"] / run["step_time_s"] - 1
        if self.bookkeeping:
            run["meter_bookkeeping_s"] = statistics.median(self.bookkeeping)
        if self.first_step_time is not None:
            run["first_step_time_s"] = self.first_step_time
        peaks = [r.get("alloc_start_bytes", 0) + r["alloc_peak_bytes"]
                 for recs in self.measured.values() for r in recs if "alloc_peak_bytes" in r]
        if peaks:
            run["alloc_peak_total_bytes"] = max(peaks)
        reserved = [r["reserved_peak_bytes"] for recs in self.measured.values() for r in recs
                    if "reserved_peak_bytes" in r]
        if peaks and reserved:
            run["reserved_peak_total_bytes"] = max(reserved)
            # cached but unallocated at the peaks: the caching allocator's fragmentation
            run["fragmentation_bytes"] = run["reserved_peak_total_bytes"] - run["alloc_peak_total_bytes"]
        nvml = [r["nvml_peak_bytes"] for recs in self.measured.values() for r in recs
                if "nvml_peak_bytes" in r]
        if nvml:
            run["nvml_peak_total_bytes"] = max(nvml)
        if self.cuda:  # near a budget the allocator frees its cache and retries: slow steps
            run["alloc_retries"] = alloc_retries(self.device) - self.retries_before_run
        run["host_peak_bytes"] = host_peak_bytes()
        if self.neighbours is not None and self.neighbours.most is not None:
            run["gpu_other_processes"] = self.neighbours.most
        return run


def host_peak_bytes() -> float:
    """The process's peak resident host memory so far: what the host held beside the device at
    the run's busiest, pinned offload buffers, data and the libraries included. Linux's VmHWM
    (the peak of this process image: getrusage's ru_maxrss would also count what the parent
    held before exec); getrusage elsewhere (KiB, bytes on macOS)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)


def _param_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
