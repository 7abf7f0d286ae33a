"""Tensors that lie in host memory and are read and written a strip of rows at a time on the
device: what tile:stream keeps of a tiled region's boundaries, and a loss's target.

Trade-off: device memory for PCIe traffic. A tensor that only strip-wise code reads (a tiled
region's input, a chunked loss's target) need not be whole on the device: each strip is copied
in as it is needed and each written strip copied out, so the device holds a strip's worth.
Copies from and to pinned memory are asynchronous on the current stream, which orders them
with the kernels that read and write the same rows; the additions are the device path's, in
the same order, so values do not change.
"""
from __future__ import annotations

import torch


def on_device(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """`t` on `device` (itself where it lies there, or no device is asked for); a copy from
    pinned host memory is asynchronous on the current stream."""
    if device is None or t.device == device:
        return t
    return t.to(device, non_blocking=True)


def host_empty(shape, dtype: torch.dtype, device: torch.device | None,
               memory_format=torch.contiguous_format) -> torch.Tensor:
    """An uninitialised host tensor, pinned where the work runs on CUDA (`device`), so that
    copies to and from it are asynchronous and run at full PCIe speed."""
    return torch.empty(shape, dtype=dtype, device="cpu", memory_format=memory_format,
                       pin_memory=device is not None and device.type == "cuda")


def add_rows(full: torch.Tensor, lo: int, hi: int, part: torch.Tensor) -> None:
    """full[..., lo:hi, :] += part, where `full` may be a host tensor and `part` on the device:
    the rows are brought in, added on the device and written back (a strip's worth of device
    memory; the same additions in the same order as on the device)."""
    rows = full[..., lo:hi, :]
    if rows.device == part.device:
        rows += part
        return
    summed = rows.to(part.device, non_blocking=True)
    summed += part
    rows.copy_(summed, non_blocking=True)
