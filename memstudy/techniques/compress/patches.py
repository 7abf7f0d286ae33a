"""ReLU and max-pool forwards whose saved tensors are smaller and still exact.

ReLU's backward needs only the sign of its output: a 1-bit mask instead of the (quantised)
output keeps it exact. Max-pool saves int64 indices: where each maximum sits in its window
(4 bits for 3 x 3) rebuilds them exactly. Both are patched on the module instances (modules and
state_dict unchanged) and stay plain inside checkpoint regions, where nothing they saved would
outlive the region.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from memstudy.techniques.compress.codec import POOL_OFFSETS, Compressor, _dense_stride
import memstudy.techniques.compress.quantize as qk
from memstudy.runtime import CheckpointRegions


class _SignMaskedReLU(torch.autograd.Function):
    """ReLU that saves its output's sign as bits: backward = grad where out > 0."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, inplace: bool, compressor: Compressor) -> torch.Tensor:
        if inplace:
            ctx.mark_dirty(x)
            out = x.relu_()
        else:
            out = x.relu()
        dense = out if _dense_stride(out) is not None else out.contiguous()
        ctx.compressor, ctx.stride = compressor, dense.stride()
        ctx.save_for_backward(compressor.pack_signs(out, dense))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (signs,) = ctx.saved_tensors
        if grad.stride() != ctx.stride:  # the mask is in the output's memory order
            grad = torch.empty_strided(grad.shape, ctx.stride, dtype=grad.dtype,
                                       device=grad.device).copy_(grad)
        return ctx.compressor.apply_signs(grad, signs), None, None


def _masked_relu_forward(module: nn.ReLU, compressor: Compressor, regions: CheckpointRegions,
                         x: torch.Tensor) -> torch.Tensor:
    # inside a checkpoint region the mask would be packed in forward only to be discarded, and
    # packed again in the recomputation for one region's backward: two kernels per ReLU for
    # no memory kept across phases
    if (compressor.active and torch.is_grad_enabled() and x.requires_grad
            and not regions.active):
        return _SignMaskedReLU.apply(x, module.inplace, compressor)
    return torch.nn.functional.relu(x, inplace=module.inplace)


def patch_relus(model: nn.Module, compressor: Compressor,
                regions: CheckpointRegions | None = None) -> int:
    """Give every nn.ReLU instance the sign-mask forward (plain inside the checkpoint regions
    `regions` counts: the run's); returns how many were patched."""
    relus = [m for m in model.modules() if type(m) is nn.ReLU]
    regions = regions or CheckpointRegions()
    for relu in relus:
        relu.forward = functools.partial(_masked_relu_forward, relu, compressor, regions)
    return len(relus)


class _OffsetIndexMaxPool(torch.autograd.Function):
    """2-D max-pool that saves where each maximum sits in its window (4 bits for a 3 x 3
    window) instead of its int64 flat index (64 bits): backward rebuilds the exact indices
    and runs PyTorch's own max-pool backward on them, so the gradient is bit-identical."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pool: nn.MaxPool2d) -> torch.Tensor:
        out, indices = torch.nn.functional.max_pool2d(
            x, pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode,
            return_indices=True)
        ctx.window = qk.PoolWindow(x.shape[-1], out.shape[-2], out.shape[-1],
                                   *(_pair(getattr(pool, a)) for a in POOL_ARGS))
        ctx.pool, ctx.in_shape, ctx.out_shape = pool, x.shape, out.shape
        offsets = qk.window_offsets(indices, ctx.window)
        setattr(offsets, POOL_OFFSETS, indices.untyped_storage().nbytes())
        ctx.save_for_backward(offsets)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (offsets,) = ctx.saved_tensors
        indices = qk.window_indices(offsets, ctx.window, ctx.out_shape)
        # the op reads only the input's shape: a zero-stride stand-in, no input kept
        shape_only = grad.new_zeros(()).expand(ctx.in_shape)
        pool = ctx.pool
        grad_in = torch.ops.aten.max_pool2d_with_indices_backward(
            grad, shape_only, _pair(pool.kernel_size), _pair(pool.stride), _pair(pool.padding),
            _pair(pool.dilation), pool.ceil_mode, indices)
        return grad_in, None


POOL_ARGS = ("kernel_size", "stride", "padding", "dilation")


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _offset_pool_forward(module: nn.MaxPool2d, compressor: Compressor,
                         regions: CheckpointRegions, x: torch.Tensor) -> torch.Tensor:
    if (compressor.active and torch.is_grad_enabled() and x.requires_grad
            and not regions.active):  # as for the ReLU masks
        return _OffsetIndexMaxPool.apply(x, module)
    return nn.MaxPool2d.forward(module, x)


def patch_maxpools(model: nn.Module, compressor: Compressor,
                   regions: CheckpointRegions | None = None) -> int:
    """Give every nn.MaxPool2d instance (without return_indices, with a window of at most 256
    places: one byte per offset) the offset-saving forward."""
    pools = [m for m in model.modules() if type(m) is nn.MaxPool2d and not m.return_indices
             and math.prod(_pair(m.kernel_size)) <= 256]
    regions = regions or CheckpointRegions()
    for pool in pools:
        pool.forward = functools.partial(_offset_pool_forward, pool, compressor, regions)
    return len(pools)
