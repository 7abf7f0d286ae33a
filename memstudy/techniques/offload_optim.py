"""offload_optim: the optimizer state lives in page-locked host memory between steps.

Memory / compute trade-off: Adam's two moments are twice the parameters' bytes (186 MiB for
the U-Net's 93 MiB of float32 parameters), held on the device through every forward and
backward although only the optimizer step reads them. Here they wait in pinned host buffers
and come to the device one bucket of parameters at a time during the step, so forward and
backward run with no optimizer state on the device, and the step with at most two buckets of
it. The cost is PCIe traffic: the state crosses the bus twice per step (host -> device before
its bucket steps, device -> host after), 2 x state bytes, overlapped with the buckets' steps
(on an H100 the U-Net's Adam kernels are shorter than the copies: the step phase went from
4.8 to 18.0 ms, docs/techniques/offload_optim.md), plus the host RAM itself
(recorded as `optim_host_bytes`).

How (a wrapper of the optimizer factory, as zero's; `HostStateOptimizer`):
- buckets: the parameters, in their groups' order, cut into runs of at most `bucket` parameter
  bytes; a parameter larger than `bucket` is a bucket of its own (a bucket holds at least one
  parameter).
- the inner step: the wrapped optimizer's own `step`, with its param_groups narrowed to the
  bucket's parameters (the same group dicts, fewer params), so hyper-parameters, per-group
  settings, foreach and the `step` counters stay torch's; elementwise optimizers compute the
  same bytes whatever the grouping (tested bitwise against the plain optimizer).
- state tensors on the compute device move; any other (Adam's non-capturable `step` counter
  lives on the CPU) stays where it is. Each bucket's moving state is laid out in one flat
  host buffer (`BucketLayout`), so a bucket crosses the bus in one copy each way.
- pipeline, on one side CUDA stream, events only (no host sync in the step): two flat device
  buffers (a ring) are allocated from the compute stream's pool as the step starts; bucket
  i + 1's state is copied into one while bucket i steps in the other; after bucket i steps,
  its state is copied out to its host buffer, and bucket i + 2 is copied into the same device
  buffer behind it on the side stream. At the step's end the ring is freed (record_stream: its
  memory is reusable once the last copy out is done).
- first step (no state yet): the inner step creates the bucket's state, which is copied out
  and its device memory released (record_stream) before the next bucket creates its own, so
  the first step's peak is about one bucket's state too. A bucket whose state changes later
  (a parameter's first gradient, a tensor replaced) is laid out again the same way.
- state_dict waits for the last copy out (a host sync, outside the step) and holds the host
  tensors; load_state_dict is torch's (it casts the state to the parameters' device), after
  which the state goes to host buffers bucket by bucket. A checkpoint of either loads into
  the other.
On the CPU there is no separate host memory: the technique is refused there, and the CPU
tests construct `HostStateOptimizer` directly (host = compute = cpu).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from memstudy.config import positive_bytes
from memstudy.env import indexed_device
from memstudy.errors import ConfigError, MemstudyError
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import OffloadOptimOptions as Options

# Optimizers whose update of a parameter reads only that parameter, its gradient, its state
# and its group's settings (per element): narrowing the groups changes no byte of it.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam)
# Techniques that own or reshape the optimizer state or the parameters it is keyed by.
OWN_THE_STATE = {
    "zero": "zero shards the optimizer state over dp ranks (ZeroRedundancyOptimizer)",
    "fsdp": "fsdp shards the optimizer state with the parameters (DTensors)",
    "tri_accel": "tri_accel rebuilds the optimizer with one group per unit",
    "lowrank": "lowrank replaces parameters during the run",
    "ab": "ab swaps the parameter groups during the run",
}
ALIGN = 256  # bytes: each state tensor's place in a flat buffer starts on this boundary


def bucket_bytes(opts: Options) -> int:
    """`bucket` in bytes; a malformed or non-positive size is refused, naming the option."""
    return positive_bytes(opts.bucket, "offload_optim:bucket",
                          f"offload_optim:bucket={opts.bucket!r} must be a positive byte size, "
                          "e.g. offload_optim:bucket=64MB")


def check(opts: Options, plan: Plan) -> None:
    bucket_bytes(opts)
    if plan.device.type != "cuda":
        raise ConfigError(f"offload_optim keeps the optimizer state in host memory between "
                          f"steps, but train.device resolves to {plan.device.type}, where it "
                          "already is; use train.device=cuda or drop offload_optim")
    for name, why in OWN_THE_STATE.items():
        if plan.has(name):
            raise ConfigError(f"offload_optim with {name}: {why}; drop {name} or offload_optim")
    split = plan.declaring("splits_model")
    if split or plan.gpus_per_process() > 1:
        raise ConfigError(f"offload_optim moves the state of one compute device, but "
                          f"{(split or ['a technique'])[0]} places parameters on several; "
                          "drop one of them")


class _Copies:
    """The side stream the state crosses the bus on, and the events that order it against the
    compute stream; on the CPU copies are synchronous and the events None."""

    def __init__(self, compute: torch.device):
        self.compute = compute
        self.side = torch.cuda.Stream(compute) if compute.type == "cuda" else None
        self.last: Any = None  # the event after the last copy to the host

    @property
    def asynchronous(self) -> bool:
        return self.side is not None

    def side_waits_compute(self) -> None:
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(self.compute))

    def compute_waits(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.compute).wait_event(event)

    @contextlib.contextmanager
    def on_side(self) -> Iterator[None]:
        with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
            yield

    def mark(self) -> Any:
        """An event after the copies issued so far on the side stream."""
        if self.side is None:
            return None
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def release(self, t: torch.Tensor) -> None:
        """t's memory (compute stream's pool) is not handed out again before the side stream's
        copies queued so far are done."""
        if self.side is not None:
            t.record_stream(self.side)

    def wait_for_host(self) -> None:
        """The host waits for the last copy out (outside the step: state_dict)."""
        if self.last is not None:
            self.last.synchronize()


@dataclass
class Slot:
    """One state tensor's place in its bucket's flat buffers."""
    param: torch.Tensor
    key: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class BucketLayout:
    """Where a bucket's moving state lives: `host`, one flat buffer of `nbytes`, and the
    place of each tensor in it (and in a device buffer during the step)."""
    slots: list[Slot]
    nbytes: int
    host: torch.Tensor


def _dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    """t's strides where its elements are one dense block (so a flat slice holds it), else
    the contiguous ones (the copy reorders it; only the layout changes, not a value)."""
    dense = t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
    return tuple(t.stride()) if dense else tuple(torch.empty(t.shape, device="meta").stride())


def plan_slots(entries: list[tuple[torch.Tensor, str, torch.Tensor]]) -> tuple[list[Slot], int]:
    """Aligned places for (param, key, tensor) entries in one flat buffer, and its bytes."""
    slots, offset = [], 0
    for param, key, t in entries:
        slots.append(Slot(param, key, offset, tuple(t.shape), _dense_stride(t), t.dtype))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return slots, offset


def view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor of `slot` inside the flat uint8 buffer `flat`."""
    size = math.prod(slot.shape) * slot.dtype.itemsize
    return flat[slot.offset:slot.offset + size].view(slot.dtype).as_strided(slot.shape, slot.stride)


def make_buckets(param_groups: list[dict], limit: int) -> list[list[tuple[int, list]]]:
    """Runs of parameters (in group order) of at most `limit` bytes, each as (group index,
    its params in the bucket) pairs; a parameter above `limit` is a bucket of its own."""
    buckets: list[dict[int, list]] = []
    current: dict[int, list] = {}
    size = 0
    for index, group in enumerate(param_groups):
        for p in group["params"]:
            if current and size + p.nbytes > limit:
                buckets.append(current)
                current, size = {}, 0
            current.setdefault(index, []).append(p)
            size += p.nbytes
    if current:
        buckets.append(current)
    return [list(b.items()) for b in buckets]


@contextlib.contextmanager
def narrowed(optimizer: torch.optim.Optimizer, members: list[tuple[int, list]]) -> Iterator[None]:
    """optimizer.param_groups cut to a bucket for one step: the same group dicts (so every
    setting is the group's own), holding only the bucket's params; restored after."""
    groups = optimizer.param_groups
    chosen = [groups[index] for index, _ in members]
    full = [group["params"] for group in chosen]
    for group, (_, params) in zip(chosen, members):
        group["params"] = params
    optimizer.param_groups = chosen
    try:
        yield
    finally:
        optimizer.param_groups = groups
        for group, params in zip(chosen, full):
            group["params"] = params


class HostStateOptimizer(torch.optim.Optimizer):
    """`inner`'s step, bucket by bucket, its state on `compute` kept in `host` memory between
    steps. Shares `inner`'s param_groups and state (what the LR policy and the meters read)."""

    def __init__(self, inner: torch.optim.Optimizer, compute: torch.device, limit: int,
                 host: torch.device = torch.device("cpu")):
        _check_inner(inner)
        super().__init__(inner.param_groups, inner.defaults)
        self.inner, self.limit, self.host = inner, limit, torch.device(host)
        self.param_groups, self.state = inner.param_groups, inner.state
        self.compute = indexed_device(torch.device(compute))
        self.pin = self.compute.type == "cuda" and self.host.type == "cpu"
        self.copies = _Copies(self.compute)
        self.layouts: dict[int, BucketLayout] = {}  # bucket index -> its state's host layout
        self._signature: tuple | None = None
        self._buckets: list[list[tuple[int, list]]] = []
        self._placed: dict[tuple[int, str], torch.Tensor] = {}  # views handed to the inner step
        self._arrived: dict[int, torch.Tensor] = {}  # bucket -> its ring buffer, this step

    # -- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        buckets = self.buckets()
        ring = self._ring()
        arrivals = {0: self._fetch(0, ring)} if buckets else {}
        for i, members in enumerate(buckets):
            if i + 1 < len(buckets):
                arrivals[i + 1] = self._fetch(i + 1, ring)
            self.copies.compute_waits(arrivals.pop(i))
            with narrowed(self.inner, members):
                self.inner.step()
            self._store(i)
        for buffer in ring:
            self.copies.release(buffer)
        self._placed.clear()
        self._arrived.clear()
        return loss

    def buckets(self) -> list[list[tuple[int, list]]]:
        """The buckets of the current param_groups (made again only when they change, which
        is refused once state is laid out: the layouts belong to the buckets)."""
        signature = tuple(tuple(id(p) for p in g["params"]) for g in self.param_groups)
        if signature != self._signature:
            if self.layouts:
                raise MemstudyError("offload_optim: the optimizer's parameter groups changed "
                                    "after its state moved to the host; build a new optimizer")
            self._signature, self._buckets = signature, make_buckets(self.param_groups, self.limit)
        return self._buckets

    def _ring(self) -> list[torch.Tensor]:
        """Device buffers for the buckets with a layout: two (one stepping, one arriving), or
        one for a single such bucket; the side stream waits for the work that freed them."""
        if not self.layouts:
            return []
        size = max(layout.nbytes for layout in self.layouts.values())
        ring = [torch.empty(size, dtype=torch.uint8, device=self.compute)
                for _ in range(min(2, len(self.layouts)))]
        self.copies.side_waits_compute()
        return ring

    def _fetch(self, i: int, ring: list[torch.Tensor]) -> Any:
        """Bucket i's state copied into a ring buffer on the side stream (behind the copy out
        of the bucket that used it before); its views stand in the state. The event to wait
        for, or None (no layout yet: the inner step creates the state)."""
        layout = self.layouts.get(i)
        if layout is None:
            return None
        flat = self._arrived[i] = ring[i % len(ring)][:layout.nbytes]
        with self.copies.on_side():
            flat.copy_(layout.host, non_blocking=self.pin)
        for slot in layout.slots:
            placed = self.state[slot.param][slot.key] = view(flat, slot)
            self._placed[(id(slot.param), slot.key)] = placed
        return self.copies.mark()

    def _store(self, i: int) -> None:
        """Bucket i's device state copied to its host buffer after its step (the side stream
        waits for it); host views stand in the state from now on."""
        entries = self._device_entries(self._buckets[i])
        flat = self._arrived.pop(i, None)
        if not entries:  # no state on the device (no gradient yet, or none kept)
            self.layouts.pop(i, None)
            return
        self.copies.side_waits_compute()
        layout = self.layouts.get(i)
        if flat is not None and self._unchanged(layout, entries):
            with self.copies.on_side():
                layout.host.copy_(flat, non_blocking=self.pin)
        else:
            layout = self.layouts[i] = self._lay_out(entries)
        for slot in layout.slots:
            self.state[slot.param][slot.key] = view(layout.host, slot)
        self.copies.last = self.copies.mark()

    def _unchanged(self, layout: BucketLayout, entries: list[tuple]) -> bool:
        """The step updated the views it was given in place and made no other state."""
        return len(entries) == len(layout.slots) and all(
            self._placed.get((id(p), key)) is t for p, key, t in entries)

    def _lay_out(self, entries: list[tuple]) -> BucketLayout:
        """A new host buffer for these state tensors, each copied into its place (the first
        step, or a bucket whose state changed); their device memory is released behind the
        copies."""
        slots, nbytes = plan_slots(entries)
        host = torch.empty(nbytes, dtype=torch.uint8, device=self.host, pin_memory=self.pin)
        with self.copies.on_side():
            for slot, (_, _, t) in zip(slots, entries):
                view(host, slot).copy_(t, non_blocking=self.pin)
        for _, _, t in entries:
            self.copies.release(t)
        return BucketLayout(slots, nbytes, host)

    def _device_entries(self, members: list[tuple[int, list]]) -> list[tuple]:
        """(param, key, tensor) for the bucket's state tensors on the compute device."""
        return [(p, key, t) for _, params in members for p in params
                for key, t in self.state.get(p, {}).items()
                if isinstance(t, torch.Tensor) and t.device == self.compute]

    # -- the rest of the optimizer's interface ------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict of the state in host memory, once the last copy there is done."""
        self.copies.wait_for_host()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading (checks, casts to the parameters' device), then every bucket's state
        to host buffers; the host waits for the copies (outside the step)."""
        self.copies.wait_for_host()
        self.inner.load_state_dict(state_dict)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        self.layouts.clear()
        self._signature = None
        for i in range(len(self.buckets())):
            self._store(i)
        self.copies.wait_for_host()

    def host_bytes(self) -> int:
        """Host bytes the offloaded state holds."""
        return sum(layout.nbytes for layout in self.layouts.values())

    def series(self, rank: int) -> list[tuple[int, int, str, float]]:
        """Run facts (series step 0): host bytes, buckets, the largest bucket's state bytes."""
        largest = max((layout.nbytes for layout in self.layouts.values()), default=0)
        return [(rank, 0, "optim_host_bytes", float(self.host_bytes())),
                (rank, 0, "optim_buckets", float(len(self._buckets))),
                (rank, 0, "optim_bucket_bytes", float(largest))]


def _check_inner(inner: torch.optim.Optimizer) -> None:
    if type(inner) not in ELEMENTWISE:
        raise ConfigError(f"offload_optim steps the optimizer one bucket of parameters at a time, "
                          f"which gives the same result only for elementwise optimizers "
                          f"({', '.join(c.__name__ for c in ELEMENTWISE)}); "
                          f"{type(inner).__name__} is not one: drop offload_optim")
    if inner._optimizer_step_pre_hooks or inner._optimizer_step_post_hooks:
        raise ConfigError("offload_optim: the optimizer it wraps has step hooks, which would run "
                          "once per bucket; register them on the offload_optim optimizer")


def host_state(factory, compute: torch.device, limit: int):
    """Wrap an optimizer factory: the same optimizer, its state in host memory between steps."""
    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        return HostStateOptimizer(factory(model), compute, limit)
    return make


def apply(opts: Options, build: Build) -> None:
    made: list[HostStateOptimizer] = []
    wrapped = host_state(build.runtime.optimizer_factory, build.device, bucket_bytes(opts))

    def factory(model: torch.nn.Module) -> torch.optim.Optimizer:
        made.append(wrapped(model))
        return made[-1]

    build.runtime.optimizer_factory = factory
    build.runtime.series_sources.append(
        lambda: made[-1].series(build.runtime.rank) if made else [])
    build.notes["offload_optim"] = {"bucket_bytes": bucket_bytes(opts)}


# PARALLEL, order 5: it wraps the optimizer factory as zero does, before every later wrapper
# of it (daso's and ab's step pre-hooks, the LR policy after all techniques): their hooks then
# run once per training step on this optimizer, not once per bucket on the one it wraps.
register(Technique("offload_optim", Stage.PARALLEL, Options,
                   "optimizer state in pinned host RAM between steps, brought back a bucket at a "
                   "time: state bytes of device memory for 2 x state bytes of PCIe per step",
                   apply, check, order=5))
