"""offload: tensors saved for backward go to (pinned) host memory in forward, come back in backward.

Memory / compute trade-off: the activations autograd keeps between forward and backward - the
bulk of forward memory at large image sizes - live in host RAM instead of GPU memory, so the
device holds only parameters, gradients, optimizer state, the tensors of the op running now,
and the small saved tensors below `min_bytes`. The cost is PCIe traffic: every offloaded byte
crosses the bus twice per step (device -> host in forward, host -> device in backward), plus
the host RAM itself (reported as `saved_host_bytes`).

How (a pack / unpack pair in the runtime's chain of saved-tensor transforms,
`add_saved_tensor_transform`, so the harness meters see what stays on the device):
- pack: a saved tensor on the compute device of at least `min_bytes` is copied into a host
  buffer (page-locked when `pin_memory`) on a side CUDA stream that first waits for the
  compute stream; the copy then overlaps with the following forward kernels. The device
  tensor is marked used by the side stream (`record_stream`), so the caching allocator does
  not hand its memory to a later kernel before the copy has read it. Parameters (leaves that
  require grad) stay where they are: they are alive anyway. A tensor saved by several ops
  (a ReLU output saved by the ReLU and by the next convolution) is copied once.
- unpack: the compute stream waits for that copy's event, then copies the buffer back
  (non-blocking from pinned memory). With `prefetch=0` each copy is issued when autograd asks
  for the tensor, so the host -> device traffic is on the critical path of backward.
- prefetch (`prefetch=N`): host copies are numbered in pack order. When autograd unpacks copy
  i, the copies below i (backward runs roughly in reverse pack order) are started on the side
  stream, until N copies are in flight (brought back and not yet used); a later unpack of a
  prefetched copy only makes the compute stream wait for its event. So the transfer of the
  next tensors overlaps the backward kernels of the current ones, at the cost of up to N
  extra device tensors alive. A prefetched copy serves every unpack of its tensor (a ReLU
  output saved twice is brought back once); a copy whose saved tensor autograd frees unused
  leaves the window. The values are the same bytes: gradients are identical to prefetch=0.
  A copy brought back on demand that several saved tensors share is kept for their unpacks
  too (each Function of a tile region saves the region's inputs: a full-resolution boundary
  crossed the bus once per Function before), until its last use or the next copy brought
  back on demand.
- which: `all` saved tensors (above min_bytes), or only `boundaries`, the tensors checkpoint
  (and tile) mark as kept between regions (`runtime.mark_boundary`): the region inputs and
  skip connections, which dominate what checkpointed runs still save.

With `compress`: the runtime chains compress before offload, so offload receives compressed
objects and moves their payload (codes; the per-group statistics too when above min_bytes):
fewer bytes over PCIe, brought back before compress restores the tensor.

Interplay: inside a non-reentrant `checkpoint` region, checkpoint's own saved-tensor hooks
take precedence, so those tensors are neither saved nor offloaded (they are recomputed);
offload acts on what is saved outside regions, on the region inputs (torch's checkpoint saves
them through the surrounding hooks), and on what `checkpoint:selective` keeps (it routes
those through the surrounding hooks too). `invertible`'s momentum stages save their output and velocity, which are offloaded.
On the CPU there is no separate host memory: the technique is refused there, and the CPU
tests exercise the pack / unpack pair directly (`Offloader`, host = compute = cpu).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from memstudy.errors import ConfigError
from memstudy.runtime import is_boundary
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique

OFFLOADED = "_memstudy_offloaded"  # attribute on a host copy: (compute device, copy event, index)
WHICH = ("all", "boundaries")


@dataclass
class Options:
    min_bytes: int = field(default=64 * 1024, metadata={
        "help": "saved tensors smaller than this stay on the device (copies of small tensors "
                "cost more in latency than they save)"})
    pin_memory: bool = field(default=True, metadata={
        "help": "page-locked host buffers: asynchronous copies that overlap with compute; "
                "false uses pageable memory and synchronous copies"})
    prefetch: int = field(default=0, metadata={
        "help": "backward brings copies back ahead of use on a side stream, at most this many "
                "in flight (0: each copy is made when autograd asks for it)"})
    which: str = field(default="all", metadata={
        "choices": WHICH,
        "help": "all: every saved tensor above min_bytes; boundaries: only the tensors "
                "checkpoint / tile keep between regions"})


class Offloader:
    """The pack / unpack pair. `compute` is where tensors are computed; `host` where they wait."""

    def __init__(self, compute: torch.device, host: torch.device = torch.device("cpu"),
                 min_bytes: int = 64 * 1024, pin_memory: bool = False, prefetch: int = 0,
                 boundaries_only: bool = False):
        self.compute, self.host = _indexed(torch.device(compute)), torch.device(host)
        self.min_bytes, self.pin_memory = min_bytes, pin_memory
        self.prefetch, self.boundaries_only = prefetch, boundaries_only
        cuda = self.compute.type == "cuda"
        self.stream = torch.cuda.Stream(self.compute) if cuda else None
        # id(device tensor) -> (weak ref to it, its version, host copy): one copy per tensor.
        self._copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
        self.offloaded_bytes = 0  # device -> host bytes so far (a running total)
        self.restored_bytes = 0  # host -> device bytes so far
        self.copy_times = CopyTimes() if cuda else None
        self._window = PrefetchWindow(self._start_copy_back, prefetch)

    def pack(self, packed: Any) -> Any:
        """A tensor, or an earlier transform's packed object (compress), whose tensors move."""
        if self.boundaries_only and not is_boundary(packed):
            return packed
        if self._window.start_forward():
            self._copies.clear()  # a new forward: copies of the last one are not reused
        if isinstance(packed, torch.Tensor):
            return self._offload(packed)
        if hasattr(packed, "map_tensors"):
            return packed.map_tensors(self._offload)
        return packed

    def _offload(self, t: torch.Tensor) -> torch.Tensor:
        if t.device != self.compute or t.nbytes < self.min_bytes or (t.is_leaf and t.requires_grad):
            return t
        known = self._copies.get(id(t))
        if known is not None and known[0]() is t and known[1] == t._version:
            self._window.count_use(getattr(known[2], OFFLOADED)[2])
            return known[2]
        host = self._copy_to_host(t)
        key = id(t)
        self._copies[key] = (weakref.ref(t, lambda _r, k=key: self._copies.pop(k, None)),
                             t._version, host)
        return host

    def _copy_to_host(self, t: torch.Tensor) -> torch.Tensor:
        dense = t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)
        stride = t.stride() if dense else torch.empty(t.shape, device="meta").stride()
        host = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=self.host,
                                   pin_memory=self.pin_memory and self.host.type == "cpu")
        event = None
        if self.stream is None:
            host.copy_(t)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.compute))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=self.pin_memory)
                event = torch.cuda.Event()
                event.record(self.stream)
            t.record_stream(self.stream)  # keep t's memory until the side-stream copy has read it
        setattr(host, OFFLOADED, (self.compute, event, self._window.add(host)))
        self.offloaded_bytes += host.nbytes
        return host

    def unpack(self, packed: Any) -> Any:
        if isinstance(packed, torch.Tensor):
            return self._restore(packed)
        if hasattr(packed, "map_tensors"):
            return packed.map_tensors(self._restore)
        return packed

    def _restore(self, host: torch.Tensor) -> torch.Tensor:
        info = getattr(host, OFFLOADED, None)
        if info is None:
            return host  # never offloaded
        device, event, index = info
        ready = self._window.take(index)
        if ready is None:
            restored = self._copy_back(host, device, event)
            self._window.hold(index, restored)  # for the copy's other saved tensors, if any
        else:
            restored, copied = ready
            if copied is not None:
                stream = torch.cuda.current_stream(device)
                self.copy_times.needed(copied, stream)
                stream.wait_event(copied)
                restored.record_stream(stream)  # used here: not freed for the side stream early
        self._window.advance(index)
        return restored

    def _copy_back(self, host: torch.Tensor, device: torch.device, event: Any) -> torch.Tensor:
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
        self.restored_bytes += host.nbytes
        if device == host.device:
            return host.clone()  # CPU tests: a fresh tensor, as a real copy back would be
        stream = torch.cuda.current_stream(device)
        with self.copy_times.on_demand(stream):  # on the compute stream: exposed in full
            return host.to(device, non_blocking=self.pin_memory)

    def _start_copy_back(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A prefetch: the copy back issued on the side stream (ordered after the copy out)."""
        device = getattr(host, OFFLOADED)[0]
        if self.stream is None:
            return self._copy_back(host, device, None), None
        self.restored_bytes += host.nbytes
        with torch.cuda.stream(self.stream):
            started = self.copy_times.start(self.stream)
            restored = host.to(device, non_blocking=True)
            copied = torch.cuda.Event(enable_timing=True)
            copied.record(self.stream)
        self.copy_times.prefetched(started, copied)
        return restored, copied

    @property
    def transfer_stats(self) -> dict[str, float]:
        """Bytes each way and, on CUDA, the copies back's time and the part of it the compute
        stream waited for (exposed on the critical path). Read once the device is idle (the end
        of a run): events still pending are left out of the times."""
        found = {"d2h_bytes": float(self.offloaded_bytes), "h2d_bytes": float(self.restored_bytes)}
        if self.copy_times is not None:
            found.update(self.copy_times.totals())
        return found

    @property
    def stats(self) -> dict[str, float]:
        return {**self._window.stats, **self.transfer_stats}


class CopyTimes:
    """How long backward's copies back took, and how much of that the compute stream waited.

    Timed with CUDA events only (no host sync inside a step): a prefetched copy is bracketed on
    the side stream, and when the compute stream needs it an event there marks the moment; the
    copy is exposed by max(0, copy end - need). A copy made on demand runs on the compute stream
    itself, so all of it is exposed. Finished pairs are folded into running sums as new copies
    are recorded (`Event.query` does not wait), so a long run keeps a bounded number of events;
    the rest are read in `totals`, when the device is idle."""

    FOLD_AT = 256  # pending event pairs that trigger folding the finished ones

    def __init__(self):
        self._prefetched: dict[int, list] = {}  # id(end event) -> [start, end, need or None]
        self._on_demand: list[tuple[Any, Any]] = []
        self._copy_ms = self._exposed_ms = 0.0  # of the pairs already folded

    @staticmethod
    def start(stream) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def prefetched(self, started, copied) -> None:
        self._prefetched[id(copied)] = [started, copied, None]
        self._fold_if_many()

    def needed(self, copied, stream) -> None:
        entry = self._prefetched.get(id(copied))
        if entry is not None and entry[2] is None:
            entry[2] = self.start(stream)

    @contextlib.contextmanager
    def on_demand(self, stream):
        started = self.start(stream)
        yield
        self._on_demand.append((started, self.start(stream)))
        self._fold_if_many()

    def _fold_if_many(self) -> None:
        if len(self._prefetched) + len(self._on_demand) >= self.FOLD_AT:
            self._fold(final=False)

    def _fold(self, final: bool) -> None:
        """Add the finished pairs to the sums and drop them. A prefetched copy not needed yet
        stays (its need may come) unless `final`: then it counts as copied, not exposed."""
        for key, (started, copied, need) in list(self._prefetched.items()):
            if not copied.query() or (need is not None and not need.query()):
                continue
            if need is None and not final:
                continue
            self._copy_ms += started.elapsed_time(copied)
            if need is not None:
                self._exposed_ms += max(0.0, need.elapsed_time(copied))
            del self._prefetched[key]
        pending = []
        for started, ended in self._on_demand:
            if not ended.query():
                pending.append((started, ended))
                continue
            duration = started.elapsed_time(ended)
            self._copy_ms, self._exposed_ms = self._copy_ms + duration, self._exposed_ms + duration
        self._on_demand = pending

    def totals(self) -> dict[str, float]:
        self._fold(final=True)
        return {"h2d_copy_ms": self._copy_ms, "h2d_exposed_ms": self._exposed_ms}


class PrefetchWindow:
    """Which host copies to bring back ahead of use, and how many may be in flight.

    Copies are numbered in pack order within one forward; backward unpacks them roughly in
    reverse. The window brings back the highest-numbered copy that still has uses to come and
    lies below the *frontier* - the lowest copy whose last use has come - while fewer than
    `limit` are in flight (started and still awaiting a use).

    A copy several saved tensors share is unpacked more than once, and its first use may come
    far out of order: a skip connection saved by an encoder stage and, much later in forward,
    by a decoder block is first unpacked by that decoder block, early in backward. Only a last
    use moves the frontier, so such an early use does not drag it down past every copy in
    between (an earlier version moved its cursor to any unpacked index, and after the first
    skip connection nothing more was prefetched: 32 of 200 copies brought back in a tiled
    4188 px run, H100, native-4188-4gib-prefetch1.sqlite under benchmarks/results). A
    prefetched copy the frontier has passed unused is dropped: backward went another way.
    """

    def __init__(self, start_copy, limit: int):
        self.start_copy, self.limit = start_copy, limit
        self._sequence: list[weakref.ref] = []  # host copies of this forward, in pack order
        self._left: list[int] = []  # uses still to come of each copy
        # index -> [device tensor, copy event, uses left, "prefetched" or "reused"]
        self._ready: dict[int, list] = {}
        self._frontier = 0  # copies at or above it have had their last use
        self._backward = False  # an unpack happened since the last pack
        self.stats = {"prefetched": 0, "on_demand": 0, "reused": 0, "max_in_flight": 0}

    def start_forward(self) -> bool:
        """A pack after backward began: a new forward numbers its copies from 0 (True)."""
        if not self._backward:
            return False
        self._sequence, self._left, self._ready = [], [], {}
        self._frontier, self._backward = 0, False
        return True

    def add(self, host: torch.Tensor) -> int:
        index = len(self._sequence)
        # a copy autograd frees unused (its node never runs) leaves the window
        self._sequence.append(weakref.ref(host, lambda _r, i=index: self._ready.pop(i, None)))
        self._left.append(1)
        self._frontier = index + 1
        return index

    def count_use(self, index: int) -> None:
        if index < len(self._left):
            self._left[index] += 1

    def take(self, index: int) -> tuple[torch.Tensor, Any] | None:
        """The copy of `index` already brought back (and its event), or None: copy it now."""
        self._backward = True
        if index < len(self._left):
            self._left[index] -= 1
        entry = self._ready.get(index)
        if entry is None:
            self.stats["on_demand"] += 1
            return None
        entry[2] -= 1
        if entry[2] <= 0:
            del self._ready[index]
        self.stats[entry[3]] += 1
        return entry[0], entry[1]

    def hold(self, index: int, restored: torch.Tensor) -> None:
        """A copy brought back on demand that more saved tensors share (the inputs every
        Function of a tile region saves) serves their unpacks too, instead of crossing the bus
        once per unpack. At most one such copy waits: the next copy brought back on demand
        replaces it (uses far apart in backward, such as a skip connection saved by an encoder
        and a decoder region, would otherwise keep it on the device in between); it also leaves
        with its last use, or when autograd frees the host copy."""
        for waiting in [i for i, entry in self._ready.items() if entry[3] == "reused"]:
            del self._ready[waiting]
        if index < len(self._left) and self._left[index] > 0:
            self._ready[index] = [restored, None, self._left[index], "reused"]

    def advance(self, index: int) -> None:
        """After unpacking `index`: move the frontier if that was its last use, then start the
        next copies below the frontier, up to `limit` in flight."""
        if self.limit <= 0 or index >= len(self._sequence):
            return
        if self._left[index] <= 0 and index < self._frontier:
            self._frontier = index
            for passed in [i for i, entry in self._ready.items()
                           if i > index and entry[3] == "prefetched"]:
                del self._ready[passed]
        while self._in_flight() < self.limit:
            i = self._next_needed()
            if i is None:
                break
            self._ready[i] = [*self.start_copy(self._sequence[i]()), self._left[i], "prefetched"]
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], self._in_flight())

    def _next_needed(self) -> int | None:
        """The highest copy below the frontier with uses to come, not on the device yet."""
        for i in range(self._frontier - 1, -1, -1):
            if self._left[i] > 0 and i not in self._ready and self._sequence[i]() is not None:
                return i
        return None

    def _in_flight(self) -> int:
        """Prefetched copies not yet used (`limit` bounds these; held on-demand copies aside)."""
        return sum(entry[3] == "prefetched" for entry in self._ready.values())


def _indexed(device: torch.device) -> torch.device:
    """'cuda' -> 'cuda:N' (the current GPU): saved tensors carry an index and must compare equal."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check(opts: Options, plan: Plan) -> None:
    if plan.device.type != "cuda":
        raise ConfigError(f"offload moves tensors saved for backward from the GPU to host memory, "
                          f"but train.device resolves to {plan.device}, where they already are; "
                          "set train.device = 'cuda' or drop offload")
    if opts.min_bytes < 0:
        raise ConfigError(f"offload: min_bytes={opts.min_bytes} must be >= 0")
    if opts.prefetch < 0:
        raise ConfigError(f"offload: prefetch={opts.prefetch} must be >= 0 (0: no prefetch)")
    if opts.prefetch and not opts.pin_memory:
        raise ConfigError("offload: prefetch needs pin_memory=true (copies from pageable memory "
                          "are synchronous, so nothing would overlap); set "
                          "offload:pin_memory=true or prefetch=0")
    if opts.which == "boundaries" and not (plan.has("checkpoint") or plan.has("tile")):
        raise ConfigError("offload: which=boundaries offloads only what checkpoint / tile keep "
                          "between regions, and neither is in techniques; add checkpoint (or "
                          "tile) or use offload:which=all")


def apply(opts: Options, build: Build) -> None:
    offloader = Offloader(build.device, torch.device("cpu"), opts.min_bytes, opts.pin_memory,
                          opts.prefetch, boundaries_only=opts.which == "boundaries")
    build.runtime.add_saved_tensor_transform(offloader.pack, offloader.unpack, owner="offload")
    build.notes["offload_min_bytes"] = opts.min_bytes
    build.runtime.series_sources.append(lambda: _prefetch_rows(offloader, build.runtime.rank))


def _prefetch_rows(offloader: Offloader, rank: int) -> list[tuple[int, int, str, float]]:
    """Run totals of backward's copies back (series step 0: they cover the whole run)."""
    return [(rank, 0, f"offload_{name}", float(value)) for name, value in offloader.stats.items()]


register(Technique("offload", Stage.ACTIVATION, Options,
                   "saved activations in host RAM: device memory for PCIe traffic", apply, check,
                   order=60))
