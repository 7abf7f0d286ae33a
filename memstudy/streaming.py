"""Tensors that lie in host memory and are read and written a strip of rows at a time on the
device: what tile:stream keeps of a tiled region's boundaries, and a loss's target.

Trade-off: device memory for PCIe traffic. A tensor that only strip-wise code reads (a tiled
region's input, a chunked loss's target) need not be whole on the device: each strip is copied
in as it is needed and each written strip copied out, so the device holds a strip's worth.
Copies run on the current (compute) stream, which orders them with the kernels. Asked to
(`side=True`, tile:ahead=true), they run on two side streams per device instead, one each way,
so that they overlap the kernels and each other (PCIe carries both directions at once): a strip
can be brought in
(`fetch`) while the strip before it computes, and written rows go out (`write_rows`) while the
next strip computes. Events order each copy with the kernels that read or write the same
memory: a fetched strip is read only after its copy is done, a written strip's device memory
is not reused before its copy is done, and rows read back to be added to (`add_rows`) wait for
every write issued before them. `settle` makes the compute stream wait for all copies issued so
far: code that reads host tensors by other means (the host itself, a copy on the compute
stream, the next region's fetches) calls it first, as every tiled sweep does at its end. The
additions are the device path's, in the same order, so values do not change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

_SIDE: dict[tuple[torch.device, str], torch.cuda.Stream] = {}  # (device, "in" / "out") -> stream
_UNSETTLED: set[torch.device] = set()  # devices with copies issued since their last settle


@dataclass
class Traffic:
    """Bytes the streamed copies moved each way since the counters were last read."""
    h2d_bytes: int = 0
    d2h_bytes: int = 0

    def take(self) -> tuple[int, int]:
        """(host to device, device to host) bytes, and the counters back to zero."""
        moved = self.h2d_bytes, self.d2h_bytes
        self.h2d_bytes = self.d2h_bytes = 0
        return moved


TRAFFIC = Traffic()


def _cuda_key(device: torch.device) -> torch.device:
    """`cuda` and `cuda:<current>` are one device, and one key."""
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.device("cuda", index)


def _side_stream(device: torch.device, way: str) -> torch.cuda.Stream:
    """The device's copy stream one `way` ("in": to the device, "out": to the host), which
    first waits for the kernels enqueued so far."""
    key = _cuda_key(device)
    if (key, way) not in _SIDE:
        _SIDE[(key, way)] = torch.cuda.Stream(key)
    stream = _SIDE[(key, way)]
    stream.wait_stream(torch.cuda.current_stream(key))
    _UNSETTLED.add(key)
    return stream


class Fetched:
    """A tensor on its way to the device: `get()` makes the current stream wait for the copy
    (or, for `pending`, runs what must come first, such as waiting for offload's rows) and
    returns it."""

    def __init__(self, tensor: torch.Tensor | None = None, done: torch.cuda.Event | None = None,
                 pending: Callable[[], torch.Tensor] | None = None):
        self.tensor, self.done, self.pending = tensor, done, pending

    def get(self) -> torch.Tensor:
        if self.pending is not None:
            return self.pending()
        if self.done is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(self.done)
        return self.tensor


def fetch(t: torch.Tensor, device: torch.device | None, side: bool = False,
          after_writes: bool = False) -> Fetched:
    """Start bringing `t` to `device`, on the current stream. With `side`, a host tensor bound
    for a CUDA device is copied on the device's side stream in, into memory allocated in the
    compute stream's order (the side stream first waits for the kernels enqueued so far, which
    may still use that memory), and with `after_writes` once every write to the host issued so
    far is done (rows the caller may have written since the last settle)."""
    if device is None or t.device == device:
        return Fetched(t)
    streamed = device.type == "cuda" and t.device.type == "cpu"
    if streamed:
        TRAFFIC.h2d_bytes += t.numel() * t.element_size()
    if not (streamed and side):
        return Fetched(t.to(device, non_blocking=True))
    target = torch.empty_like(t, device=device)
    side = _side_stream(device, "in")
    if after_writes:
        side.wait_stream(_side_stream(device, "out"))
    with torch.cuda.stream(side):
        target.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    target.record_stream(side)  # not reused before the copy is done, even if never read
    return Fetched(target, done)


def on_device(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """`t` on `device` (itself where it lies there, or no device is asked for); a copy from
    pinned host memory is asynchronous on the current stream."""
    return fetch(t, device).get()


def write_rows(rows: torch.Tensor, part: torch.Tensor, side: bool = False) -> None:
    """rows.copy_(part), on the current stream. With `side`, a copy to host `rows` runs on the
    side stream out once the kernels enqueued so far (those making `part`) are done, `part`'s
    memory kept from reuse until the copy is."""
    streamed = part.device.type == "cuda" and rows.device.type == "cpu"
    if streamed:
        TRAFFIC.d2h_bytes += part.numel() * part.element_size()
    if not (streamed and side):
        rows.copy_(part, non_blocking=True)
        return
    side = _side_stream(part.device, "out")
    with torch.cuda.stream(side):
        rows.copy_(part, non_blocking=True)
    part.record_stream(side)


def settle(device: torch.device | None) -> None:
    """The current stream of `device` waits for every streamed copy issued so far (nothing
    to wait for where none was issued since the last settle)."""
    if device is None or device.type != "cuda" or not _UNSETTLED:
        return
    key = _cuda_key(device)
    if key in _UNSETTLED:
        _UNSETTLED.discard(key)
        for way in ("in", "out"):
            if (key, way) in _SIDE:
                torch.cuda.current_stream(key).wait_stream(_SIDE[(key, way)])


def host_empty(shape, dtype: torch.dtype, device: torch.device | None,
               memory_format=torch.contiguous_format) -> torch.Tensor:
    """An uninitialised host tensor, pinned where the work runs on CUDA (`device`), so that
    copies to and from it are asynchronous and run at full PCIe speed."""
    return torch.empty(shape, dtype=dtype, device="cpu", memory_format=memory_format,
                       pin_memory=device is not None and device.type == "cuda")


def add_rows(full: torch.Tensor, lo: int, hi: int, part: torch.Tensor,
             side: bool = False) -> None:
    """full[..., lo:hi, :] += part, where `full` may be a host tensor and `part` on the device:
    the rows are brought in, added on the device and written back (a strip's worth of device
    memory; the same additions in the same order as on the device; `side`: the copies on the
    side streams)."""
    rows = full[..., lo:hi, :]
    if rows.device == part.device:
        rows += part
        return
    summed = fetch(rows, part.device, side, after_writes=True).get()
    summed += part
    write_rows(rows, summed, side)
