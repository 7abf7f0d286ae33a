"""BatchNorm with given (whole-image) statistics, fused with the ReLU that follows it.

The tiled regions normalise every strip with statistics that are inputs of the graph
(memstudy/tiling/sweep.py), so nn.BatchNorm2d cannot be used, and composing the affine map and
the ReLU from eager ops costs five elementwise kernels forward (conversion, multiply, add,
conversion, ReLU) and their autograd backward, each reading and writing a whole strip in
float32: in an H100 profile of a tiled step, elementwise kernels were about half its GPU time. `NormReLU` does it in one kernel forward (plus an in-place ReLU) and three
backward, with PyTorch's SyncBatchNorm primitives on CUDA (torch.batch_norm_elemt,
batch_norm_backward_reduce, batch_norm_backward_elemt: mixed bf16 / float32 inputs, float32
arithmetic, as cuDNN's BatchNorm under autocast). On other devices the same formulas run as
plain tensor ops in float32 (float64 for a float64 model): the reference the GPU test compares
the CUDA path with.

`kernels="triton"` (tile:norm, the default) runs the same three steps through memstudy's Triton
kernels (memstudy/tiling/norm_act.py) on a dense channels_last strip: one pass each for the
moments, the affine map + ReLU, and backward's input gradient with both per-channel sums
(PyTorch's primitives take five passes for the last two, at a fraction of the bandwidth on the
tiled levels' 16-64 channels). `kernels="torch"` keeps the primitives (and everything else, on
any device, uses them or the tensor ops).

For y = relu((z - mean) * invstd * w + b), with dy = grad_y * (y > 0) summed over N, H, W:
  grad_z = dy * invstd * w
  grad_mean = -invstd * w * sum(dy)          grad_invstd = w * sum(dy * (z - mean))
  grad_w = invstd * sum(dy * (z - mean))     grad_b = sum(dy)
(the statistics' own dependence on z is the statistics sweep's backward, not this one's).

`statistics_seed` is that backward's start: the gradient of a BatchNorm's (mean, var) with
respect to its input, shift + scale * (z - mean) per channel, plus the rows of an output
gradient where there is one, in one kernel on CUDA (the same primitives with unit invstd and
weight: their float32 arithmetic, one rounding) instead of four elementwise passes over a
float32 strip (in an H100 profile of the tiled step, 105 such generic elementwise kernels took
28 ms).
"""
from __future__ import annotations

import torch
from torch import nn

from memstudy.kernels import interpreted
from memstudy.tiling import norm_act
from memstudy.models.unet import memory_format_of

Stats = tuple[torch.Tensor, torch.Tensor]  # (mean, biased variance), one value per channel


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _channel(t: torch.Tensor) -> torch.Tensor:
    return t[:, None, None]


def fused(z: torch.Tensor, kernels: str) -> bool:
    """Whether `kernels` runs z through the Triton kernels: a CUDA strip they handle (or any
    device under TRITON_INTERPRET=1, the CPU tests)."""
    return (kernels == "triton" and norm_act.supported(z)
            and (z.is_cuda or interpreted()))


class NormReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, mean, invstd, weight, bias, relu: bool, kernels: str):
        ctx.fused = fused(z, kernels)
        if ctx.fused:
            y = norm_act.affine_act(z, mean, invstd * weight, bias, relu=relu)
        elif z.is_cuda:
            y = torch.batch_norm_elemt(z, weight, bias, mean, invstd, 0.0)
        else:
            dtype = compute_dtype(z.dtype)
            y = ((z.to(dtype) - _channel(mean)) * _channel(invstd * weight)
                 + _channel(bias)).to(z.dtype)
        if relu and not ctx.fused:
            y = y.relu_()
        ctx.relu = relu
        ctx.save_for_backward(z, mean, invstd, weight, y if relu else None)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        z, mean, invstd, weight, y = ctx.saved_tensors
        if ctx.fused:
            grad_z, sum_dy, sum_dy_xmu = norm_act.affine_relu_backward(
                grad_y, y, z, mean, invstd, weight)
            return _grads(grad_z, sum_dy, sum_dy_xmu, invstd, weight)
        dy = torch.ops.aten.threshold_backward(grad_y, y, 0) if ctx.relu else grad_y
        if z.is_cuda:
            dy = dy.contiguous(memory_format=memory_format_of(z))
            sum_dy, sum_dy_xmu, grad_w, grad_b = torch.batch_norm_backward_reduce(
                dy, z, mean, invstd, weight, True, True, True)
            zero = torch.zeros_like(sum_dy)
            # torch.full is a fill kernel; torch.tensor([...], device=...) would copy from
            # pageable host memory, a blocking sync in every backward
            count = torch.full((1,), z.numel() // z.shape[1], dtype=torch.int32, device=z.device)
            grad_z = torch.batch_norm_backward_elemt(dy, z, mean, invstd, weight, zero, zero,
                                                     count)
        else:
            dtype = compute_dtype(z.dtype)
            dy32 = dy.to(dtype)
            sum_dy = dy32.sum((0, 2, 3))
            sum_dy_xmu = (dy32 * (z.to(dtype) - _channel(mean))).sum((0, 2, 3))
            grad_w, grad_b = sum_dy_xmu * invstd, sum_dy
            grad_z = (dy32 * _channel(invstd * weight)).to(z.dtype)
        return _grads(grad_z, sum_dy, sum_dy_xmu, invstd, weight, grad_w, grad_b)


def _grads(grad_z, sum_dy, sum_dy_xmu, invstd, weight, grad_w=None, grad_b=None) -> tuple:
    """NormReLU.backward's result from the input gradient and the two per-channel sums."""
    if grad_w is None:
        grad_w, grad_b = sum_dy_xmu * invstd, sum_dy
    return (grad_z, -invstd * weight * sum_dy, weight * sum_dy_xmu, grad_w, grad_b, None, None)


def normalize(z: torch.Tensor, stats: Stats, bn: nn.modules.batchnorm._BatchNorm,
              relu: bool = False, kernels: str = "triton") -> torch.Tensor:
    """bn's affine normalisation of z with `stats` (then ReLU), differentiable in all of them."""
    mean, var = (s.to(compute_dtype(z.dtype)) for s in stats)
    invstd = torch.rsqrt(var + bn.eps)
    weight, bias = (p.to(mean.dtype) for p in (bn.weight, bn.bias))
    return NormReLU.apply(z, mean, invstd, weight, bias, relu, kernels)


def moments(z: torch.Tensor, kernels: str = "triton") -> tuple[int, torch.Tensor, torch.Tensor]:
    """(count, mean, biased variance) per channel of z, in z's compute dtype, in one pass on
    CUDA (the Triton kernels, or torch.batch_norm_stats: both read bf16 directly) or via
    var_mean elsewhere."""
    if fused(z, kernels):
        return norm_act.moments(z)
    n = z.numel() // z.shape[1]
    if z.is_cuda:
        eps = 1e-30  # batch_norm_stats returns 1/sqrt(var + eps); var is recovered from it
        mean, invstd = torch.batch_norm_stats(z, eps)
        return n, mean, invstd.pow(-2) - eps
    var, mean = torch.var_mean(z.to(compute_dtype(z.dtype)), dim=(0, 2, 3), correction=0)
    return n, mean, var


def statistics_seed(z: torch.Tensor, rows: torch.Tensor | None, mean: torch.Tensor,
                    scale: torch.Tensor, shift: torch.Tensor,
                    kernels: str = "triton") -> torch.Tensor:
    """rows + shift + scale * (z - mean) per channel (rows None: zero), in z's dtype, computed
    in the statistics' precision and rounded once. Centred first: a + b * z with a = -b * mean
    would cancel catastrophically in float32."""
    if fused(z, kernels):
        return norm_act.affine_act(z.detach(), mean, scale, shift, add=rows)
    if z.is_cuda:
        z = z.detach().contiguous(memory_format=memory_format_of(z))
        ones = torch.ones_like(mean)
        if rows is None:  # (z - mean) * invstd * weight + bias with invstd = 1
            return torch.batch_norm_elemt(z, scale, shift, mean, ones, 0.0)
        # (dy - sum_dy / n - (z - mean) * invstd^2 * sum_dy_xmu / n) * invstd * weight with
        # n = invstd = weight = 1
        count = torch.ones((1,), dtype=torch.int32, device=z.device)
        return torch.batch_norm_backward_elemt(
            rows.contiguous(memory_format=memory_format_of(z)), z, mean, ones, ones, -shift,
            -scale, count)
    centred = z.detach().to(mean.dtype) - _channel(mean)
    base = _channel(shift) if rows is None else rows + _channel(shift)
    return torch.addcmul(base, centred, _channel(scale)).to(z.dtype)
