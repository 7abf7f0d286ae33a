"""MS-SSIM computed in row chunks: pytorch-msssim's value and gradient, without its full maps.

Why: pytorch-msssim builds every statistic of every scale as a full-resolution map (the five
Gaussian-filtered maps, their products, the cs and ssim maps) and autograd keeps about a dozen
of them for backward. At 4188 x 4188 px one float32 map is 70 MB, so the loss alone saves
~1 GB that stays alive exactly when the model's activations peak (end of forward, start of
backward). The network's memory techniques cannot touch it.

How: every scale's statistic is a mean over a map whose rows depend on only `WIN_SIZE` input
rows (a valid Gaussian filter), and the loss uses one mean per scale and image (cs below the
coarsest scale, ssim at it). So the forward runs one block of `rows` output rows at a time
(each with its 10-row halo), with autograd on inside the block only: it adds the block's sums
to the means and the block's input gradient of the used mean into one gradient map per scale,
then frees the block. It saves those gradient maps (4/3 of an image for all scales) and the
means. Backward needs no recomputation: d loss / d mean per image (from the small means)
scales each scale's map, and the scales are chained back through pytorch-msssim's average
pooling.
Memory: the loss's saved tensors drop from about a dozen full maps to 4/3 of one; its
temporaries drop from full maps to one block's maps.
Cost: one forward and one backward per block, as pytorch-msssim does for the whole image, plus
a kernel launch overhead per block that grows as `rows` shrinks (bench_loss.py measures it).
An earlier version ran the blocks without autograd in forward and again with it in backward
(2.5x pytorch-msssim's time at 4188 px on an H100, bench_loss).

The target may lie in host memory (tile:stream): its pyramid is pooled there and each block
of it is copied in as the block is computed.

Same value: the blocks use pytorch-msssim's `gaussian_filter` (once on the five inputs stacked
along channels), its window, padding and pooling, its `_ssim` formula with its constants, and
the terms are combined by the same relu / pow / prod; only the order of the sums differs
(float rounding). tests/test_loss_memory.py checks value and gradient against pytorch-msssim
in float64.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from pytorch_msssim.ssim import _fspecial_gauss_1d, gaussian_filter

from memstudy.streaming import add_rows, on_device, settle

WIN_SIGMA = 1.5  # pytorch-msssim's default
C1, C2 = 0.01 ** 2, 0.03 ** 2  # pytorch-msssim's (K1 data_range)^2, (K2 data_range)^2, data_range 1


def _constants(win_size: int, channels: int, weights: tuple[float, ...],
               like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gaussian window and the scale weights on like's device and dtype, made once: a copy
    from host memory in every step would be a blocking host-device sync."""
    return _device_constants(win_size, channels, tuple(weights), like.device, like.dtype)


@functools.lru_cache(maxsize=32)
def _device_constants(win_size: int, channels: int, weights: tuple[float, ...],
                      device: torch.device, dtype: torch.dtype):
    win = _fspecial_gauss_1d(win_size, WIN_SIGMA).repeat([channels, 1, 1, 1])
    return win.to(device, dtype=dtype), torch.tensor(weights, dtype=dtype).to(device)


def _pool(x: torch.Tensor) -> torch.Tensor:
    """pytorch-msssim's down-sampling between scales."""
    return F.avg_pool2d(x, kernel_size=2, padding=[s % 2 for s in x.shape[2:]])


def _pyramid(x: torch.Tensor, levels: int) -> list[torch.Tensor]:
    out = [x]
    for _ in range(levels - 1):
        out.append(_pool(out[-1]))
    return out


def _blocks(height: int, win_size: int, rows: int):
    """(first input row, last input row + 1, map rows) of each block of output rows."""
    if height < win_size:  # pytorch-msssim skips the filter along a too-short side
        yield 0, height, height
        return
    out_rows = height - win_size + 1
    for start in range(0, out_rows, rows):
        n = min(rows, out_rows - start)
        yield start, start + n + win_size - 1, n


def _map_width(width: int, win_size: int) -> int:
    return width if width < win_size else width - win_size + 1


def _ssim_maps(x, y, win) -> tuple[torch.Tensor, torch.Tensor]:
    """pytorch-msssim's `_ssim` maps (data_range 1, K = (0.01, 0.03), compensation 1), with its
    own `gaussian_filter` applied once to the five inputs stacked along channels instead of five
    times: a fifth of the convolution launches, which dominate small blocks."""
    c = x.shape[1]
    stacked = torch.cat([x, y, x * x, y * y, x * y], dim=1)
    mu1, mu2, xx, yy, xy = gaussian_filter(stacked, win.repeat(5, 1, 1, 1)).split(c, dim=1)
    mu1_sq, mu2_sq, mu1_mu2 = mu1.pow(2), mu2.pow(2), mu1 * mu2
    cs_map = (2 * (xy - mu1_mu2) + C2) / ((xx - mu1_sq) + (yy - mu2_sq) + C2)
    ssim_map = ((2 * mu1_mu2 + C1) / (mu1_sq + mu2_sq + C1)) * cs_map
    return ssim_map, cs_map


def _map_count(x: torch.Tensor, win_size: int) -> int:
    height, width = x.shape[-2:]
    return _map_width(width, win_size) * _map_width(height, win_size)


def _level_pass(x, y, win, rows: int, use_ssim: bool, need: tuple[bool, bool]):
    """One scale in one pass, block by block: its (ssim, cs) means per (batch, channel) and the
    gradient maps d(sum over batch and channels of the mean the loss uses)/d(x, y). The loss
    uses one mean per scale (cs below the coarsest, ssim at it), and each (batch, channel) mean
    depends on its own image only, so backward needs nothing else: d loss / d mean, known only
    then, scales each image's map. With need (False, False): the means alone, no graph."""
    total = _map_count(x, win.shape[-1])
    grads = [torch.zeros_like(t) if n else None for t, n in zip((x, y), need)]
    ssim_sum = cs_sum = 0
    for r0, r1, _ in _blocks(x.shape[-2], win.shape[-1], rows):
        # a host target (tile:stream) is brought in a block at a time
        xb = x[..., r0:r1, :].detach().requires_grad_(need[0])
        yb = on_device(y[..., r0:r1, :], x.device).detach().requires_grad_(need[1])
        with torch.enable_grad():
            s, c = (m.flatten(2).sum(-1) for m in _ssim_maps(xb, yb, win))
            leaves = [t for t, wanted in zip((xb, yb), need) if wanted]
            found = iter(torch.autograd.grad((s if use_ssim else c).sum() / total, leaves)
                         if leaves else ())
        ssim_sum, cs_sum = ssim_sum + s.detach(), cs_sum + c.detach()
        for grad, wanted in zip(grads, need):
            if wanted:
                add_rows(grad, r0, r1, next(found))
    settle(x.device)  # a host target's gradient rows are written before anyone reads them
    return ssim_sum / total, cs_sum / total, grads


def _combine(ssim_terms: torch.Tensor, cs_terms: torch.Tensor, weights: torch.Tensor):
    """pytorch-msssim's final step: one scale is the SSIM mean; more scales are the weighted
    product of relu(cs) of the finer scales and relu(ssim) of the coarsest."""
    if len(weights) == 1:
        return ssim_terms[0].mean()
    stacked = torch.cat([torch.relu(cs_terms[:-1]), torch.relu(ssim_terms[-1:])], dim=0)
    powered = stacked ** weights.view(-1, 1, 1)
    product = powered[0]
    for term in powered[1:]:  # not torch.prod: its backward looks for zeros on the host (a sync)
        product = product * term
    return product.mean()


def _scales(x, y, weights: torch.Tensor, win, rows: int, need: tuple[bool, bool]):
    """(ssim terms, cs terms) as (levels, N, C) tensors over the pyramid of x and y, and each
    level's gradient maps for the inputs in `need` (finest first; `_level_pass`)."""
    levels = [_level_pass(xl, yl, win, rows, level == len(weights) - 1, need)
              for level, (xl, yl) in enumerate(zip(_pyramid(x, len(weights)),
                                                    _pyramid(y, len(weights))))]
    return (torch.stack([lv[0] for lv in levels]), torch.stack([lv[1] for lv in levels]),
            [lv[2] for lv in levels])


def _unpool(grad_coarse: torch.Tensor, fine_shape: torch.Size) -> torch.Tensor:
    """The gradient that `_pool` of a tensor of `fine_shape` sends back (average pooling's
    backward reads no values)."""
    leaf = grad_coarse.new_zeros(fine_shape).requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(_pool(leaf), leaf, grad_coarse)
    return grad


class ChunkedMSSSIM(torch.autograd.Function):
    """MS-SSIM (data_range 1) of (N, C, H, W) images, equal to pytorch-msssim's `ms_ssim`
    (or `ssim` for one weight) with win_size / weights as given; see the module docstring."""

    @staticmethod
    def forward(ctx, x, y, weights: tuple[float, ...], win_size: int, rows: int):
        win, w = _constants(win_size, x.shape[1], weights, x)
        need = tuple(ctx.needs_input_grad[:2])
        ssim_terms, cs_terms, level_maps = _scales(x, y, w, win, rows, need)
        # saved through save_for_backward, so that memstudy's saved-tensor meters count them
        maps = [g for grads in level_maps for g in grads if g is not None]
        ctx.save_for_backward(ssim_terms, cs_terms, *maps)
        ctx.need, ctx.weights = need, weights
        return _combine(ssim_terms, cs_terms, w)

    @staticmethod
    def backward(ctx, grad_value):
        ssim_terms, cs_terms, *maps = ctx.saved_tensors
        w = _constants(1, 1, ctx.weights, ssim_terms)[1]
        # d value / d terms: the small (levels, N, C) tensors through the library's combination
        terms = [ssim_terms.detach().requires_grad_(True), cs_terms.detach().requires_grad_(True)]
        with torch.enable_grad():
            g_ssim, g_cs = torch.autograd.grad(_combine(*terms, w), terms, grad_value,
                                               allow_unused=True)
        per_level = iter(maps)
        level_maps = [[next(per_level) if n else None for n in ctx.need] for _ in range(len(w))]
        grads: list[torch.Tensor | None] = [None, None]
        for level in reversed(range(len(w))):  # coarsest first: its gradient is pooled back
            g = g_ssim[level] if level == len(w) - 1 else g_cs[level]  # (N, C)
            for i in (0, 1):
                if ctx.need[i]:
                    here = level_maps[level][i] * g[..., None, None]
                    if grads[i] is not None:  # from the next coarser scale, through the pooling
                        here += _unpool(grads[i], here.shape)
                    grads[i] = here
        return grads[0], grads[1], None, None, None


def chunked_msssim(x: torch.Tensor, y: torch.Tensor, weights: list[float], win_size: int,
                   rows: int) -> torch.Tensor:
    if not (torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)):
        # no gradient wanted (autograd.Function would still report needs_input_grad under
        # no_grad): the value alone, without building the gradient maps
        return chunked_ssim_and_msssim(x, y, weights, win_size, rows)[1]
    return ChunkedMSSSIM.apply(x, y, tuple(weights), win_size, rows)


@torch.no_grad()
def chunked_ssim_and_msssim(x, y, weights: list[float], win_size: int,
                            rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(SSIM, MS-SSIM) of a validation batch in one chunked pass: SSIM is the finest scale's
    ssim mean, exactly pytorch-msssim's `ssim` (size_average)."""
    win, w = _constants(win_size, x.shape[1], weights, x)
    ssim_terms, cs_terms, _ = _scales(x, y, w, win, rows, (False, False))
    return ssim_terms[0].mean(), _combine(ssim_terms, cs_terms, w)
