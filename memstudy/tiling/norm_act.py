"""BatchNorm with given statistics on a channels_last strip: Triton kernels and their reference.

The tiled regions (memstudy/tiling/norm.py) normalise each strip with whole-image statistics
and need, per BatchNorm and strip: the moments of its input (statistics sweeps), the affine
map + ReLU (forward), and in backward the input gradient together with two per-channel sums.
PyTorch's SyncBatchNorm primitives do this in five kernels (batch_norm_elemt and relu_;
threshold_backward, batch_norm_backward_reduce and batch_norm_backward_elemt), each a full pass
over the strip, and on the tiled levels' few channels (16-64, channels_last) they run far
below the GPU's memory bandwidth. Here each is one pass over a [pixels, channels] view of the
strip (channels_last: a channel's values are C apart):

- `affine_act`: y = act((z - mean) * scale + shift [+ add]), float32 arithmetic, one rounding
  to z's dtype. `add` is an optional tensor of z's shape (the statistics' gradient seed adds
  an output gradient's rows).
- `affine_relu_backward`: dy = grad_y * (y > 0) (or grad_y), grad_z = dy * invstd * weight,
  and per channel sum(dy) and sum(dy * (z - mean)), from one read of grad_y, y and z: each
  program writes its partial sums, one reduction adds them (no atomics: the same bits every run).
- `moments`: the per-channel count, mean and biased variance; each block of pixels is reduced
  two-pass in registers (mean, then squared deviations), blocks are merged with Chan et al.'s
  formula inside a program and the programs' (mean, M2) by a second one-program kernel, all in
  float32: no catastrophic cancellation of E[z^2] - E[z]^2.

The references (`*_reference`) are the same formulas as plain tensor ops in float32; the tests
compare the kernels with them (TRITON_INTERPRET=1 runs the kernels on the CPU) and, on a GPU,
with PyTorch's primitives. Only dense channels_last tensors of 16- or 32-bit floats are
handled (`supported`); memstudy/tiling/norm.py runs everything else through the primitives.
"""
from __future__ import annotations

import functools

import torch

from memstudy.kernels import interpreted

PIXELS_PER_BLOCK = 4096  # elements a program handles per step, over its channels
PROGRAMS_PER_SM = 4  # reductions: a fixed grid of persistent programs (no atomics)


def supported(z: torch.Tensor) -> bool:
    """A dense channels_last (or one-channel / one-pixel) tensor of bf16, fp16 or fp32."""
    return (z.dim() == 4 and z.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and z.is_contiguous(memory_format=torch.channels_last) and z.numel() > 0)


def affine_act(z: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
               add: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """act((z - mean) * scale + shift [+ add]) per channel, in z's dtype (see module doc)."""
    pixels, channels = _check(z)
    y = torch.empty_like(z, memory_format=torch.channels_last)
    if add is not None:
        add = add.contiguous(memory_format=torch.channels_last)
    block_c, block_p = _blocks(channels)
    kernel = _kernels(interpreted())[0]
    kernel[(triton_cdiv(pixels, block_p),)](
        z, y, add if add is not None else z, *_f32(mean, scale, shift), pixels,
        C=channels, BLOCK_C=block_c, BLOCK_P=block_p, HAS_ADD=add is not None, RELU=relu)
    return y


def affine_relu_backward(grad_y: torch.Tensor, y: torch.Tensor | None, z: torch.Tensor,
                         mean: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_z, sum(dy), sum(dy * (z - mean))) for y = relu((z - mean) * invstd * weight + b)
    (y None: no ReLU), the sums per channel in float32."""
    pixels, channels = _check(z)
    grad_y = grad_y.contiguous(memory_format=torch.channels_last)
    grad_z = torch.empty_like(z, memory_format=torch.channels_last)
    block_c, block_p = _blocks(channels)
    programs = _programs(z.device, pixels, block_p)
    partial = torch.empty(2, programs, block_c, dtype=torch.float32, device=z.device)
    kernel = _kernels(interpreted())[1]
    kernel[(programs,)](
        grad_y, y if y is not None else grad_y, z, grad_z, *_f32(mean, invstd, weight), partial,
        pixels, programs, C=channels, BLOCK_C=block_c, BLOCK_P=block_p, RELU=y is not None)
    sums = partial.sum(1)[:, :channels]
    return grad_z, sums[0], sums[1]


def moments(z: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(count, mean, biased variance) per channel of z, float32."""
    pixels, channels = _check(z)
    block_c, block_p = _blocks(channels)
    programs = _programs(z.device, pixels, block_p)
    partial = torch.empty(3, programs, block_c, dtype=torch.float32, device=z.device)
    out = torch.empty(2, channels, dtype=torch.float32, device=z.device)
    block_moments, combine = _kernels(interpreted())[2:]
    block_moments[(programs,)](z, partial, pixels, programs, C=channels, BLOCK_C=block_c,
                               BLOCK_P=block_p)
    combine[(1,)](partial, out, programs, C=channels, BLOCK_C=block_c, BLOCK_G=64)
    return pixels, out[0], out[1]


# -- references: the same formulas as tensor ops ---------------------------------------------
def _channel(t: torch.Tensor) -> torch.Tensor:
    return t.float()[:, None, None]


def affine_act_reference(z, mean, scale, shift, add=None, relu=False) -> torch.Tensor:
    y = (z.float() - _channel(mean)) * _channel(scale) + _channel(shift)
    if add is not None:
        y = y + add.float()
    return (y.relu() if relu else y).to(z.dtype)


def affine_relu_backward_reference(grad_y, y, z, mean, invstd, weight):
    dy = grad_y.float() if y is None else torch.where(y > 0, grad_y.float(), 0.0)
    grad_z = (dy * _channel(invstd * weight)).to(z.dtype)
    return grad_z, dy.sum((0, 2, 3)), (dy * (z.float() - _channel(mean))).sum((0, 2, 3))


def moments_reference(z: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    var, mean = torch.var_mean(z.float(), dim=(0, 2, 3), correction=0)
    return z.numel() // z.shape[1], mean, var


# -- launch helpers ------------------------------------------------------------------------------
def _check(z: torch.Tensor) -> tuple[int, int]:
    if not supported(z):
        raise ValueError(f"norm_act kernels take a dense channels_last bf16/fp16/fp32 tensor, "
                         f"got {z.dtype} {tuple(z.shape)} strides {z.stride()}")
    if z.device.type != "cuda" and not interpreted():
        raise ValueError("norm_act kernels run on CUDA tensors, or on the CPU with "
                         "TRITON_INTERPRET=1; call the *_reference functions otherwise")
    return z.numel() // z.shape[1], z.shape[1]


def _f32(*per_channel: torch.Tensor) -> list[torch.Tensor]:
    return [t.float().contiguous() for t in per_channel]


def _blocks(channels: int) -> tuple[int, int]:
    block_c = 1 << (channels - 1).bit_length()
    return block_c, max(1, PIXELS_PER_BLOCK // block_c)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _programs(device: torch.device, pixels: int, block_p: int) -> int:
    return max(1, min(triton_cdiv(pixels, block_p), PROGRAMS_PER_SM * _sm_count(device)))


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: few programs, each looping over several blocks
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """Build the kernels (interpreted or compiled, as TRITON_INTERPRET says now)."""
    del interpret  # part of the cache key only: triton reads the variable itself at decoration
    import triton
    import triton.language as tl

    @triton.jit
    def affine_act_kernel(z_ptr, y_ptr, add_ptr, mean_ptr, scale_ptr, shift_ptr, pixels,
                          C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
                          HAS_ADD: tl.constexpr, RELU: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        cols = tl.arange(0, BLOCK_C)
        col_ok = cols < C
        mask = (rows[:, None] < pixels) & col_ok[None, :]
        offs = rows[:, None].to(tl.int64) * C + cols[None, :]
        mean = tl.load(mean_ptr + cols, mask=col_ok, other=0.0)
        scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
        shift = tl.load(shift_ptr + cols, mask=col_ok, other=0.0)
        z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (z - mean[None, :]) * scale[None, :] + shift[None, :]
        if HAS_ADD:
            y += tl.load(add_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if RELU:
            y = tl.maximum(y, 0.0)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def backward_kernel(gy_ptr, y_ptr, z_ptr, gz_ptr, mean_ptr, invstd_ptr, weight_ptr,
                        partial_ptr, pixels, programs, C: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_P: tl.constexpr, RELU: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_C)
        col_ok = cols < C
        mean = tl.load(mean_ptr + cols, mask=col_ok, other=0.0)
        invstd = tl.load(invstd_ptr + cols, mask=col_ok, other=0.0)
        scale = invstd * tl.load(weight_ptr + cols, mask=col_ok, other=0.0)
        sum_dy = tl.zeros([BLOCK_C], dtype=tl.float32)
        sum_dy_xmu = tl.zeros([BLOCK_C], dtype=tl.float32)
        for start in tl.range(pid * BLOCK_P, pixels, programs * BLOCK_P):
            rows = start + tl.arange(0, BLOCK_P)
            mask = (rows[:, None] < pixels) & col_ok[None, :]
            offs = rows[:, None].to(tl.int64) * C + cols[None, :]
            dy = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if RELU:
                y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                dy = tl.where(y > 0, dy, 0.0)
            z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(gz_ptr + offs, (dy * scale[None, :]).to(gz_ptr.dtype.element_ty), mask=mask)
            sum_dy += tl.sum(dy, axis=0)
            sum_dy_xmu += tl.sum(tl.where(mask, dy * (z - mean[None, :]), 0.0), axis=0)
        tl.store(partial_ptr + pid * BLOCK_C + cols, sum_dy)
        tl.store(partial_ptr + (programs + pid) * BLOCK_C + cols, sum_dy_xmu)

    @triton.jit
    def block_moments_kernel(z_ptr, partial_ptr, pixels, programs, C: tl.constexpr,
                             BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_C)
        col_ok = cols < C
        count = tl.zeros([BLOCK_C], dtype=tl.float32)
        mean = tl.zeros([BLOCK_C], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
        for start in tl.range(pid * BLOCK_P, pixels, programs * BLOCK_P):
            rows = start + tl.arange(0, BLOCK_P)
            row_ok = rows < pixels
            mask = row_ok[:, None] & col_ok[None, :]
            z = tl.load(z_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            n = tl.sum(row_ok.to(tl.float32), axis=0)
            block_mean = tl.sum(z, axis=0) / n
            d = tl.where(mask, z - block_mean[None, :], 0.0)
            block_m2 = tl.sum(d * d, axis=0)
            total = count + n  # Chan et al.: merge the block into the program's moments
            delta = block_mean - mean
            mean += delta * (n / total)
            m2 += block_m2 + delta * delta * (count * n / total)
            count = total
        tl.store(partial_ptr + pid * BLOCK_C + cols, count)
        tl.store(partial_ptr + (programs + pid) * BLOCK_C + cols, mean)
        tl.store(partial_ptr + (2 * programs + pid) * BLOCK_C + cols, m2)

    @triton.jit
    def combine_kernel(partial_ptr, out_ptr, programs, C: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_G: tl.constexpr):
        cols = tl.arange(0, BLOCK_C)
        count = tl.zeros([BLOCK_C], dtype=tl.float32)
        total = tl.zeros([BLOCK_C], dtype=tl.float32)
        for g0 in tl.range(0, programs, BLOCK_G):  # pass 1: count and mean
            g = g0 + tl.arange(0, BLOCK_G)
            offs = g[:, None] * BLOCK_C + cols[None, :]
            ok = (g < programs)[:, None]
            n = tl.load(partial_ptr + offs, mask=ok, other=0.0)
            count += tl.sum(n, axis=0)
            total += tl.sum(n * tl.load(partial_ptr + programs * BLOCK_C + offs, mask=ok,
                                        other=0.0), axis=0)
        mean = total / count
        m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
        for g0 in tl.range(0, programs, BLOCK_G):  # pass 2: the programs' M2, Chan's merge
            g = g0 + tl.arange(0, BLOCK_G)
            offs = g[:, None] * BLOCK_C + cols[None, :]
            ok = (g < programs)[:, None]
            n = tl.load(partial_ptr + offs, mask=ok, other=0.0)
            d = tl.load(partial_ptr + programs * BLOCK_C + offs, mask=ok, other=0.0) - mean[None, :]
            m2 += tl.sum(tl.load(partial_ptr + 2 * programs * BLOCK_C + offs, mask=ok, other=0.0)
                         + n * d * d, axis=0)
        col_ok = cols < C
        tl.store(out_ptr + cols, mean, mask=col_ok)
        tl.store(out_ptr + C + cols, m2 / count, mask=col_ok)

    return affine_act_kernel, backward_kernel, block_moments_kernel, combine_kernel
