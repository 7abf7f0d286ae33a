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
- row chunks (`row_chunks=N`, default 16): a tile region's input (runtime.mark_boundary with
  rows) comes back in N row chunks on the side stream, issued at once when the region's
  backward unpacks it; each tile waits (an event, no host sync) only for the chunks of its
  strip, so the rows below arrive while the tiles above compute, and no whole boundary is
  brought back early. Such copies are never prefetched. An unpack by anything else (autograd's
  own nodes) waits for every chunk. Needs a channels_last (or one-channel) layout, where each
  image's rows are one block of memory; other tensors come back whole.
- hold (`hold=N`): the last N distinct tensors a forward would offload stay on the device:
  backward needs them first, so their round trip would add PCIe traffic and, under a budget,
  memory held until the copy out has read it. The count comes from the forward before
  (`LastSaved`); the first forward holds none.
- release (`release=stream`): a device tensor a side-stream copy reads (out) or writes (back)
  is not marked with `record_stream`; when it is freed, the compute stream first waits for
  the copy, so the memory is reusable at once (the allocator would otherwise hold it until it
  sees the copy done). Measured slower under the 4 GiB cap (the compute stream waits for
  copies queued behind others; the retries stayed): docs/techniques/offload.md.
- early (`early=true`, with tile): a tile region's inputs start their copy out as the region
  begins (runtime.watching_boundaries), overlapping its sweeps; the saves after the sweeps
  take the copy made. Measured no faster under the 4 GiB cap.
- back_pool (`back_pool=side`): the device memory a copy back on the side stream writes into
  comes from the side stream's own pool, so the copy waits only for its copy out, not for the
  work queued on the compute stream when it was issued (`compute`, the default: memory from
  the compute stream's pool, possibly still read by that queued work, so the side stream
  first waits for it; a prefetch then starts only when the GPU reaches the unpack that issued
  it). The price: memory freed there is cached for the side stream, and near a budget the
  compute stream's allocations may flush it (allocator retries).
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

import bisect
import contextlib
import weakref
from typing import Any

import torch

from memstudy.env import indexed_device
from memstudy.errors import ConfigError
from memstudy.runtime import ROWS_IN, is_boundary, read_by_rows, watching_boundaries
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import OffloadOptions as Options

# attribute on a host copy: (compute device, copy event, index, read by rows)
OFFLOADED = "_memstudy_offloaded"


class Offloader:
    """The pack / unpack pair. `compute` is where tensors are computed; `host` where they wait."""

    def __init__(self, compute: torch.device, host: torch.device = torch.device("cpu"),
                 min_bytes: int = 64 * 1024, pin_memory: bool = False, prefetch: int = 0,
                 boundaries_only: bool = False, row_chunks: int = 0, hold: int = 0,
                 release: str = "record", back_pool: str = "compute"):
        self.compute, self.host = indexed_device(torch.device(compute)), torch.device(host)
        self.release, self.back_pool = release, back_pool
        self.early_copies = 0  # copies started as their tile region began (`early`)
        self.min_bytes, self.pin_memory = min_bytes, pin_memory
        self.prefetch, self.boundaries_only = prefetch, boundaries_only
        cuda = self.compute.type == "cuda"
        # chunks need asynchronous copies: a CUDA device and page-locked host buffers
        self.row_chunks = row_chunks if cuda and pin_memory else 0
        self.stream = torch.cuda.Stream(self.compute) if cuda else None
        # id(device tensor) -> (weak ref to it, its version, host copy): one copy per tensor.
        self._copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
        self.offloaded_bytes = 0  # device -> host bytes so far (a running total)
        self.restored_bytes = 0  # host -> device bytes so far
        self.by_rows = 0  # copies back made in row chunks (tile region inputs) so far
        self.copy_times = CopyTimes() if cuda else None
        self._window = PrefetchWindow(self._start_copy_back, prefetch)
        self._last = LastSaved(hold)

    def pack(self, packed: Any) -> Any:
        """A tensor, or an earlier transform's packed object (compress), whose tensors move."""
        if self.boundaries_only and not is_boundary(packed):
            return packed
        self._new_forward()
        if isinstance(packed, torch.Tensor):
            return self._offload(packed)
        if hasattr(packed, "map_tensors"):
            return packed.map_tensors(self._offload)
        return packed

    def _new_forward(self) -> None:
        if self._window.start_forward():
            self._copies.clear()  # a new forward: copies of the last one are not reused
            self._last.start_forward()

    def early(self, t: torch.Tensor) -> None:
        """`early`: a tile region's input (runtime.watching_boundaries) starts its copy as the
        region starts; the saves after its sweeps find the copy made (the same bytes: sweeps
        only read their inputs). Not in a forward without grad (validation), which saves
        nothing."""
        if torch.is_grad_enabled():
            self._new_forward()
            self._offload(t, saved=False)

    def _offload(self, t: torch.Tensor, saved: bool = True) -> torch.Tensor:
        """The host copy standing for `t` (made now, or earlier for an earlier save of t), or
        t itself where it stays; `saved`: autograd saves t now (a use of the copy), not an
        `early` start."""
        if t.device != self.compute or t.nbytes < self.min_bytes or (t.is_leaf and t.requires_grad):
            return t
        known = self._copies.get(id(t))
        if known is not None and known[0]() is t and known[1] == t._version:
            if saved:
                self._window.count_use(getattr(known[2], OFFLOADED)[2])
            return known[2]
        if self._last.holds(t):
            return t
        self.early_copies += not saved  # a new copy started as its region began
        host = self._copy_to_host(t, uses=int(saved))
        key = id(t)
        self._copies[key] = (weakref.ref(t, lambda _r, k=key: self._copies.pop(k, None)),
                             t._version, host)
        return host

    def _copy_to_host(self, t: torch.Tensor, uses: int = 1) -> torch.Tensor:
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
            self._keep_until_copied(t, event)
        by_rows = bool(self.row_chunks) and read_by_rows(t) and _rows_dense(t)
        setattr(host, OFFLOADED, (self.compute, event, self._window.add(host, by_rows, uses),
                                  by_rows))
        self.offloaded_bytes += host.nbytes
        return host

    def _keep_until_copied(self, t: torch.Tensor, copied: Any) -> None:
        """t's memory, from the compute stream's pool, must not be handed out again before the
        side stream's copy from it (out) or into it (back) is done. `record`: the allocator
        holds the block until it sees `copied` done (record_stream: an event the side stream
        records when t is freed, after any copy queued there since), checked on the host when
        it looks for memory; near a budget the host, ahead of the GPU, may find it not
        done, reach the cap and retry (a device sync and a cache flush). `stream`: when t
        is freed, the compute stream first waits for `copied` (queued before the block can be
        handed out again: the finalizer runs as t dies), so the block is reusable at once and
        the wait, if any, is on the GPU; a copy back the compute stream waited for already
        costs nothing more."""
        if self.release == "stream":
            waits = weakref.finalize(t, torch.cuda.current_stream(self.compute).wait_event, copied)
            waits.atexit = False  # at exit nothing reuses the memory
        else:
            t.record_stream(self.stream)

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
        device, event, index, by_rows = info
        ready = self._window.take(index)
        if ready is None:
            if by_rows:
                restored = self._copy_back_by_rows(host, device)
            else:
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
        if by_rows and not ROWS_IN.wanted:  # autograd's own nodes read the whole tensor
            ROWS_IN.await_rows(restored, 0, restored.shape[-2])
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
        restored = self._side_stream_target(host, device)
        with torch.cuda.stream(self.stream):
            started = self.copy_times.start(self.stream)
            restored.copy_(host, non_blocking=True)
            copied = torch.cuda.Event(enable_timing=True)
            copied.record(self.stream)
        self._keep_until_copied(restored, copied)
        self.copy_times.prefetched(started, copied)
        return restored, copied

    def _side_stream_target(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Device memory for a copy back on the side stream. It comes from the compute
        stream's pool, where it is freed: memory allocated on the side stream would be cached
        for the side stream only, and near a budget the compute stream's allocations would
        then flush the cache and retry. The side stream waits for the work queued so far,
        which may still be using that memory; the caller keeps the memory until its copy is
        done (`_keep_until_copied`). With `back_pool=side` the memory comes from the side
        stream's pool instead: nothing queued on the compute stream uses it, so the copy waits
        only for the copies queued before it on the side stream; the compute stream's uses of
        it are recorded (`record_stream` on the compute stream) before it is freed."""
        self.restored_bytes += host.nbytes
        if self.back_pool == "side":
            with torch.cuda.stream(self.stream):
                return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype,
                                           device=device)
        restored = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        return restored

    def _copy_back_by_rows(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The copy back of a tile region's input, issued in row chunks on the side stream
        (after the copy out: same stream) and handed out at once; a reader by rows waits for
        the chunks of each strip (runtime.RowArrivals), so the copy of the rows below overlaps
        with the tiles above."""
        restored = self._side_stream_target(host, device)
        self.by_rows += 1
        ends = row_chunk_ends(host.shape[-2], self.row_chunks)
        copied = []
        with torch.cuda.stream(self.stream):
            started, top = self.copy_times.start(self.stream), 0
            for bottom in ends:
                for n in range(host.shape[0]):  # one dense block per image (_rows_dense)
                    restored[n, :, top:bottom].copy_(host[n, :, top:bottom], non_blocking=True)
                done = torch.cuda.Event(enable_timing=True)
                done.record(self.stream)
                self.copy_times.prefetched(started, done)
                copied.append(done)
                started, top = done, bottom
        self._keep_until_copied(restored, copied[-1])  # chunks land in order: the last, all
        if self.back_pool == "side":  # read on the compute stream: freed only after those reads
            restored.record_stream(torch.cuda.current_stream(device))
        ROWS_IN.arriving(restored, ArrivingRows(ends, copied, self.copy_times, device))
        return restored

    @property
    def held_bytes(self) -> int:
        """Bytes kept on the device by `hold` so far (a running total; each tensor once)."""
        return self._last.held_bytes

    @property
    def transfer_stats(self) -> dict[str, float]:
        """Bytes each way and, on CUDA, the copies back's time and the part of it the compute
        stream waited for (exposed on the critical path). Read once the device is idle (the end
        of a run): events still pending are left out of the times."""
        found = {"d2h_bytes": float(self.offloaded_bytes), "h2d_bytes": float(self.restored_bytes),
                 "by_rows": float(self.by_rows), "held_bytes": float(self.held_bytes),
                 "early": float(self.early_copies)}
        if self.copy_times is not None:
            found.update(self.copy_times.totals())
        return found

    @property
    def stats(self) -> dict[str, float]:
        return {**self._window.stats, **self.transfer_stats}


class LastSaved:
    """Which tensors `hold` keeps on the device: the last N distinct tensors a forward would
    offload. A forward does not know which save is its last, so the count comes from the
    forward before (the same model and technique set save the same tensors each step); the
    first forward holds none. A tensor saved twice (a tile region's input, by each of its
    Functions) counts once and is held for both."""

    def __init__(self, hold: int):
        self.hold = hold
        self._seen = 0  # distinct tensors this forward offered
        self._total = 0  # ... and the forward before
        self._held: dict[int, weakref.ref] = {}  # id -> the held tensor (not kept alive here)
        self.held_bytes = 0

    def start_forward(self) -> None:
        self._total, self._seen = self._seen, 0
        self._held.clear()

    def holds(self, t: torch.Tensor) -> bool:
        """Keep `t` on the device? Call once per save of a tensor not offloaded yet."""
        known = self._held.get(id(t))
        if known is not None and known() is t:
            return True
        index, self._seen = self._seen, self._seen + 1
        if not self.hold or not self._total or index < self._total - self.hold:
            return False
        self._held[id(t)] = weakref.ref(t)
        self.held_bytes += t.nbytes
        return True


class ArrivingRows:
    """The row chunks of one copy back, as they land: `wait(lo, hi)` makes the current stream
    wait for the chunks that hold rows lo:hi (chunks land in order: waiting for the last of
    them covers the ones above); `all_waited` says whether the last chunk is waited for, `done()`
    (without waiting) whether all have landed. Registered with runtime.ROWS_IN."""

    def __init__(self, ends: list[int], copied: list, copy_times: "CopyTimes",
                 device: torch.device):
        self.ends, self.copied, self.copy_times, self.device = ends, copied, copy_times, device
        self.waited = -1  # the last chunk the compute stream waits for already

    def wait(self, lo: int, hi: int) -> None:
        last = min(bisect.bisect_left(self.ends, hi), len(self.ends) - 1)
        if last <= self.waited:
            return
        stream = torch.cuda.current_stream(self.device)
        for passed in self.copied[self.waited + 1:last]:
            self.copy_times.covered(passed)  # their wait is the last chunk's
        self.copy_times.needed(self.copied[last], stream)
        stream.wait_event(self.copied[last])
        self.waited = last

    @property
    def all_waited(self) -> bool:
        return self.waited == len(self.ends) - 1

    def done(self) -> bool:
        return self.copied[-1].query()


def row_chunk_ends(rows: int, chunks: int) -> list[int]:
    """The last row (exclusive) of each of `chunks` near-equal chunks of `rows` rows."""
    chunks = max(1, min(chunks, rows))
    return [rows * (k + 1) // chunks for k in range(chunks)]


def _rows_dense(t: torch.Tensor) -> bool:
    """Each image's rows a:b of `t` are one dense block of memory (N, C, H, W channels_last, or
    one channel), so a chunk of rows is one copy per image."""
    if t.dim() != 4:
        return False
    return (t.shape[1] == 1 and t.is_contiguous()) or t.is_contiguous(
        memory_format=torch.channels_last)


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

    def covered(self, copied) -> None:
        """A copy the compute stream waits for through a later one's event (row chunks): its
        time counts, its exposure is the later one's."""
        entry = self._prefetched.get(id(copied))
        if entry is not None and entry[2] is None:
            entry[2] = False

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
            if not copied.query() or (need and not need.query()):
                continue
            if need is None and not final:
                continue
            self._copy_ms += started.elapsed_time(copied)
            if need:  # None: never needed; False: covered by a later copy's wait
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
        self._on_demand: set[int] = set()  # copies never prefetched (add)
        self._backward = False  # an unpack happened since the last pack
        self.stats = {"prefetched": 0, "on_demand": 0, "reused": 0, "max_in_flight": 0}

    def start_forward(self) -> bool:
        """A pack after backward began: a new forward numbers its copies from 0 (True)."""
        if not self._backward:
            return False
        self._sequence, self._left, self._ready, self._on_demand = [], [], {}, set()
        self._frontier, self._backward = 0, False
        return True

    def add(self, host: torch.Tensor, on_demand: bool = False, uses: int = 1) -> int:
        """Number a new host copy with its `uses` so far (0: made before any save, offload's
        `early`); `on_demand`: never prefetched (a tile region's input comes back by rows when
        asked for: prefetched, all of it would sit on the device early)."""
        index = len(self._sequence)
        if on_demand:
            self._on_demand.add(index)
        # a copy autograd frees unused (its node never runs) leaves the window
        self._sequence.append(weakref.ref(host, lambda _r, i=index: self._ready.pop(i, None)))
        self._left.append(uses)
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
            if (self._left[i] > 0 and i not in self._ready and i not in self._on_demand
                    and self._sequence[i]() is not None):
                return i
        return None

    def _in_flight(self) -> int:
        """Prefetched copies not yet used (`limit` bounds these; held on-demand copies aside)."""
        return sum(entry[3] == "prefetched" for entry in self._ready.values())


def check(opts: Options, plan: Plan) -> None:
    if plan.device.type != "cuda":
        raise ConfigError(f"offload moves tensors saved for backward from the GPU to host memory, "
                          f"but train.device resolves to {plan.device}, where they already are; "
                          "set train.device = 'cuda' or drop offload")
    if opts.min_bytes < 0:
        raise ConfigError(f"offload: min_bytes={opts.min_bytes} must be >= 0")
    if opts.row_chunks < 0:
        raise ConfigError(f"offload: row_chunks={opts.row_chunks} must be >= 0 (0: whole "
                          "tensors, no row chunks)")
    if opts.hold < 0:
        raise ConfigError(f"offload: hold={opts.hold} must be >= 0 (0: every saved tensor "
                          "above min_bytes goes to the host)")
    if opts.prefetch < 0:
        raise ConfigError(f"offload: prefetch={opts.prefetch} must be >= 0 (0: no prefetch)")
    if opts.prefetch and not opts.pin_memory:
        raise ConfigError("offload: prefetch needs pin_memory=true (copies from pageable memory "
                          "are synchronous, so nothing would overlap); set "
                          "offload:pin_memory=true or prefetch=0")
    if opts.early and not plan.has("tile"):
        raise ConfigError("offload: early starts the copies of tile regions' inputs as the "
                          "regions start, and tile is not in techniques; add tile or drop early")
    if opts.early and plan.has("compress"):
        raise ConfigError("offload: early copies a tile region's input as it is, and compress "
                          "packs it compressed when it is saved; drop early or compress")
    if opts.back_pool == "side" and not (opts.prefetch or opts.row_chunks):
        raise ConfigError("offload: back_pool=side places the copies back made on the side "
                          "stream, and with prefetch=0 and row_chunks=0 there are none; set "
                          "prefetch or row_chunks, or drop back_pool")
    if opts.which == "boundaries" and not (plan.has("checkpoint") or plan.has("tile")):
        raise ConfigError("offload: which=boundaries offloads only what checkpoint / tile keep "
                          "between regions, and neither is in techniques; add checkpoint (or "
                          "tile) or use offload:which=all")


def apply(opts: Options, build: Build) -> None:
    offloader = Offloader(build.device, torch.device("cpu"), opts.min_bytes, opts.pin_memory,
                          opts.prefetch, boundaries_only=opts.which == "boundaries",
                          row_chunks=opts.row_chunks, hold=opts.hold, release=opts.release,
                          back_pool=opts.back_pool)
    build.runtime.add_saved_tensor_transform(offloader.pack, offloader.unpack, owner="offload")
    if opts.early:
        build.runtime.forward_contexts.append(lambda: watching_boundaries(offloader.early))
    build.notes["offload_min_bytes"] = opts.min_bytes
    build.runtime.series_sources.append(lambda: _prefetch_rows(offloader, build.runtime.rank))


def _prefetch_rows(offloader: Offloader, rank: int) -> list[tuple[int, int, str, float]]:
    """Run totals of backward's copies back (series step 0: they cover the whole run)."""
    return [(rank, 0, f"offload_{name}", float(value)) for name, value in offloader.stats.items()]


register(Technique("offload", Stage.ACTIVATION, Options,
                   "saved activations in host RAM: device memory for PCIe traffic", apply, check,
                   order=60))
