"""offload: tensors saved for backward go to (pinned) host memory in forward, come back in backward.

Memory / compute trade-off: the activations autograd keeps between forward and backward - the
bulk of forward memory at large image sizes - live in host RAM instead of GPU memory, so the
device holds only parameters, gradients, optimizer state, the tensors of the op running now,
and the small saved tensors below `min_bytes`. The cost is PCIe traffic: every offloaded byte
crosses the bus twice per step (device -> host in forward, host -> device in backward), plus
the host RAM itself (reported as `saved_host_bytes`).

How (a `saved_tensors_hooks` pack / unpack pair, installed through the runtime's
`set_saved_tensor_transform`, so the harness meters see what stays on the device):
- pack: a saved tensor on the compute device of at least `min_bytes` is copied into a host
  buffer (page-locked when `pin_memory`) on a side CUDA stream that first waits for the
  compute stream; the copy then overlaps with the following forward kernels. The device
  tensor is marked used by the side stream (`record_stream`), so the caching allocator does
  not hand its memory to a later kernel before the copy has read it. Parameters (leaves that
  require grad) stay where they are: they are alive anyway. A tensor saved by several ops
  (a ReLU output saved by the ReLU and by the next convolution) is copied once.
- unpack: the compute stream waits for that copy's event, then copies the buffer back
  (non-blocking from pinned memory). Backward copies are not prefetched: each one is issued
  when autograd asks for the tensor, so the host -> device traffic is on the critical path
  of backward. That is the main limit of this implementation (see docs/techniques/offload.md).

Interplay: inside a non-reentrant `checkpoint` region, checkpoint's own saved-tensor hooks
take precedence, so those tensors are neither saved nor offloaded (they are recomputed);
offload acts on what is saved outside regions, plus what `checkpoint:selective` keeps (it
routes those through the surrounding hooks). The region inputs checkpoint holds stay on
the device. `invertible`'s momentum stages save their output and velocity, which are offloaded.
On the CPU there is no separate host memory: the technique is refused there, and the CPU
tests exercise the pack / unpack pair directly (`Offloader`, host = compute = cpu).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from memstudy.errors import ConfigError
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique

OFFLOADED = "_memstudy_offloaded"  # attribute on a host copy: (compute device, copy event)


@dataclass
class Options:
    min_bytes: int = field(default=64 * 1024, metadata={
        "help": "saved tensors smaller than this stay on the device (copies of small tensors "
                "cost more in latency than they save)"})
    pin_memory: bool = field(default=True, metadata={
        "help": "page-locked host buffers: asynchronous copies that overlap with compute; "
                "false uses pageable memory and synchronous copies"})


class Offloader:
    """The pack / unpack pair. `compute` is where tensors are computed; `host` where they wait."""

    def __init__(self, compute: torch.device, host: torch.device = torch.device("cpu"),
                 min_bytes: int = 64 * 1024, pin_memory: bool = False):
        self.compute, self.host = _indexed(torch.device(compute)), torch.device(host)
        self.min_bytes, self.pin_memory = min_bytes, pin_memory
        cuda = self.compute.type == "cuda"
        self.stream = torch.cuda.Stream(self.compute) if cuda else None
        # id(device tensor) -> (weak ref to it, its version, host copy): one copy per tensor.
        self._copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
        self.offloaded_bytes = 0  # host bytes copied so far (a running total, for tests/notes)

    def pack(self, t: torch.Tensor) -> Any:
        if t.device != self.compute or t.nbytes < self.min_bytes or (t.is_leaf and t.requires_grad):
            return t
        known = self._copies.get(id(t))
        if known is not None and known[0]() is t and known[1] == t._version:
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
        setattr(host, OFFLOADED, (self.compute, event))
        self.offloaded_bytes += host.nbytes
        return host

    def unpack(self, packed: Any) -> torch.Tensor:
        info = getattr(packed, OFFLOADED, None)
        if info is None:
            return packed  # never offloaded
        device, event = info
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
        if device == packed.device:
            return packed.clone()  # CPU tests: a fresh tensor, as a real copy back would be
        return packed.to(device, non_blocking=self.pin_memory)


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


def apply(opts: Options, build: Build) -> None:
    offloader = Offloader(build.device, torch.device("cpu"), opts.min_bytes, opts.pin_memory)
    build.runtime.set_saved_tensor_transform(offloader.pack, offloader.unpack, owner="offload")
    build.notes["offload_min_bytes"] = opts.min_bytes


register(Technique("offload", Stage.ACTIVATION, Options,
                   "saved activations in host RAM: device memory for PCIe traffic", apply, check,
                   order=60))
