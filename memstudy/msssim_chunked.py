"""MS-SSIM computed in row chunks: pytorch-msssim's value and gradient, without its full maps.

Why: pytorch-msssim builds every statistic of every scale as a full-resolution map (the five
Gaussian-filtered maps, their products, the cs and ssim maps) and autograd keeps about a dozen
of them for backward. At 4188 x 4188 px one float32 map is 70 MB, so the loss alone saves
~1 GB that stays alive exactly when the model's activations peak (end of forward, start of
backward). The network's memory techniques cannot touch it.

How: every scale's statistic is a mean over a map whose rows depend on only `WIN_SIZE` input
rows (a valid Gaussian filter). So the forward runs without autograd, one block of `rows`
output rows at a time (each with its 10-row halo), and keeps only the per-image sums. It saves
nothing but its two inputs. Backward recomputes the same blocks with autograd on, one at a
time, scaled by d loss / d statistic, and adds each block's input gradient into one gradient
map per scale; the scales are chained back through pytorch-msssim's average pooling.
Memory: the loss's saved tensors drop to its inputs; its temporaries drop from full maps to
one block's maps plus one gradient map per scale (1/3 of the image for all coarser scales).
Cost: the block maps are computed twice (forward, then backward), as checkpointing does.

Same value: the blocks use pytorch-msssim's own `_ssim` and `gaussian_filter`, its window,
padding and pooling, and the terms are combined by the same relu / pow / prod; only the order
of the sums differs (float rounding). tests/test_loss_memory.py checks value and gradient
against pytorch-msssim in float64.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from pytorch_msssim.ssim import _fspecial_gauss_1d, _ssim

WIN_SIGMA = 1.5  # pytorch-msssim's default


def _window(win_size: int, channels: int, like: torch.Tensor) -> torch.Tensor:
    win = _fspecial_gauss_1d(win_size, WIN_SIGMA).repeat([channels, 1, 1, 1])
    return win.to(like.device, dtype=like.dtype)


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


def _level_means(x, y, win, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ssim, cs) means per (batch, channel) of one scale, summed block by block."""
    height, width = x.shape[-2:]
    total = _map_width(width, win.shape[-1]) * (height if height < win.shape[-1]
                                                 else height - win.shape[-1] + 1)
    ssim_sum = cs_sum = 0
    for r0, r1, n in _blocks(height, win.shape[-1], rows):
        s, c = _ssim(x[..., r0:r1, :], y[..., r0:r1, :], data_range=1.0, win=win,
                     size_average=False)
        count = n * _map_width(width, win.shape[-1])
        ssim_sum, cs_sum = ssim_sum + s * count, cs_sum + c * count
    return ssim_sum / total, cs_sum / total


def _combine(ssim_terms: torch.Tensor, cs_terms: torch.Tensor, weights: torch.Tensor):
    """pytorch-msssim's final step: one scale is the SSIM mean; more scales are the weighted
    product of relu(cs) of the finer scales and relu(ssim) of the coarsest."""
    if len(weights) == 1:
        return ssim_terms[0].mean()
    stacked = torch.cat([torch.relu(cs_terms[:-1]), torch.relu(ssim_terms[-1:])], dim=0)
    return torch.prod(stacked ** weights.view(-1, 1, 1), dim=0).mean()


def _terms(xs, ys, win, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    means = [_level_means(x, y, win, rows) for x, y in zip(xs, ys)]
    return torch.stack([m[0] for m in means]), torch.stack([m[1] for m in means])


def _level_grads(x, y, win, rows: int, g_ssim, g_cs, need: tuple[bool, bool]):
    """d(sum of g_ssim * ssim + g_cs * cs)/d(x, y) for one scale, one block of rows at a time."""
    height, width = x.shape[-2:]
    total = _map_width(width, win.shape[-1]) * (height if height < win.shape[-1]
                                                 else height - win.shape[-1] + 1)
    grads = [torch.zeros_like(t) if n else None for t, n in zip((x, y), need)]
    for r0, r1, n in _blocks(height, win.shape[-1], rows):
        xb = x[..., r0:r1, :].detach().requires_grad_(need[0])
        yb = y[..., r0:r1, :].detach().requires_grad_(need[1])
        with torch.enable_grad():
            s, c = _ssim(xb, yb, data_range=1.0, win=win, size_average=False)
            count = n * _map_width(width, win.shape[-1])
            part = ((s * g_ssim + c * g_cs) * (count / total)).sum()
            leaves = [t for t, wanted in zip((xb, yb), need) if wanted]
            found = iter(torch.autograd.grad(part, leaves))
        for grad, wanted in zip(grads, need):
            if wanted:
                grad[..., r0:r1, :] += next(found)
    return grads


def _unpool(x_fine: torch.Tensor, grad_coarse: torch.Tensor) -> torch.Tensor:
    """The gradient that `_pool(x_fine)` sends back to x_fine."""
    leaf = x_fine.detach().requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(_pool(leaf), leaf, grad_coarse)
    return grad


class ChunkedMSSSIM(torch.autograd.Function):
    """MS-SSIM (data_range 1) of (N, C, H, W) images, equal to pytorch-msssim's `ms_ssim`
    (or `ssim` for one weight) with win_size / weights as given; see the module docstring."""

    @staticmethod
    def forward(ctx, x, y, weights: tuple[float, ...], win_size: int, rows: int):
        win = _window(win_size, x.shape[1], x)
        w = x.new_tensor(weights)
        with torch.no_grad():
            ssim_terms, cs_terms = _terms(_pyramid(x, len(w)), _pyramid(y, len(w)), win, rows)
            value = _combine(ssim_terms, cs_terms, w)
        ctx.save_for_backward(x, y)
        ctx.weights, ctx.win_size, ctx.rows = weights, win_size, rows
        return value

    @staticmethod
    def backward(ctx, grad_value):
        x, y = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:2])
        win, w = _window(ctx.win_size, x.shape[1], x), x.new_tensor(ctx.weights)
        with torch.no_grad():
            xs, ys = _pyramid(x, len(w)), _pyramid(y, len(w))
            ssim_terms, cs_terms = _terms(xs, ys, win, ctx.rows)
        # d value / d terms: the small (levels, N, C) tensors through the library's combination
        terms = [ssim_terms.detach().requires_grad_(True), cs_terms.detach().requires_grad_(True)]
        with torch.enable_grad():
            g_ssim, g_cs = torch.autograd.grad(_combine(*terms, w), terms, grad_value,
                                               allow_unused=True)
        g_ssim = torch.zeros_like(ssim_terms) if g_ssim is None else g_ssim
        g_cs = torch.zeros_like(cs_terms) if g_cs is None else g_cs
        grads: list[torch.Tensor | None] = [None, None]
        for level in reversed(range(len(w))):  # coarsest first: its gradient is pooled back
            here = _level_grads(xs[level], ys[level], win, ctx.rows, g_ssim[level], g_cs[level],
                                need)
            for i in (0, 1):
                if need[i]:
                    if grads[i] is not None:  # from the next coarser scale, through the pooling
                        here[i] += _unpool((xs, ys)[i][level], grads[i])
                    grads[i] = here[i]
        return grads[0], grads[1], None, None, None


def chunked_msssim(x: torch.Tensor, y: torch.Tensor, weights: list[float], win_size: int,
                   rows: int) -> torch.Tensor:
    return ChunkedMSSSIM.apply(x, y, tuple(weights), win_size, rows)


@torch.no_grad()
def chunked_ssim_and_msssim(x, y, weights: list[float], win_size: int,
                            rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(SSIM, MS-SSIM) of a validation batch in one chunked pass: SSIM is the finest scale's
    ssim mean, exactly pytorch-msssim's `ssim` (size_average)."""
    win, w = _window(win_size, x.shape[1], x), x.new_tensor(weights)
    ssim_terms, cs_terms = _terms(_pyramid(x, len(w)), _pyramid(y, len(w)), win, rows)
    return ssim_terms[0].mean(), _combine(ssim_terms, cs_terms, w)
