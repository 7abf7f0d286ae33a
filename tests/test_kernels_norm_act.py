"""The tiled BatchNorm's Triton kernels (memstudy/tiling/norm_act.py) against their PyTorch
references and float64 (TRITON_INTERPRET=1 on the CPU), the tiling's use of them against the
primitives' path (memstudy/tiling/norm.py), and, on a GPU, against PyTorch's primitives."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from memstudy.errors import ConfigError
from memstudy.tiling import norm_act as na
from memstudy.kernels import resolve_impl
from memstudy.tiling import norm
from helpers import run_interpreted

# (1, 16, 40, 40): 1600 pixels, 7 blocks of 256 for at most 4 interpreted programs, so a
# program merges several blocks and the last block is partial; (2, 5, 9, 7): batch 2,
# 5 channels (a partial channel block), one block; (1, 64, 3, 2): fewer pixels than a block
SHAPES = [(1, 16, 40, 40), (2, 5, 9, 7), (1, 64, 3, 2)]


def _strip(shape, dtype=torch.float32, offset=0.0, seed=0) -> torch.Tensor:
    """Channels of different spreads and offsets (conv outputs before their BatchNorm)."""
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    spread = 10.0 ** torch.linspace(-2, 1, c).view(1, c, 1, 1)
    z = torch.randn(shape, generator=g, dtype=torch.float64) * spread \
        + torch.linspace(-3, 3, c).view(1, c, 1, 1) + offset
    return z.to(dtype).contiguous(memory_format=torch.channels_last)


def _per_channel(c: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5,
            torch.randn(c, generator=g)]


def check_kernels_interpreted() -> None:
    """Each kernel against its reference (float32), the moments also against float64."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for i, shape in enumerate(SHAPES):
        z = _strip(shape, seed=i)
        mean, scale, shift = _per_channel(shape[1], seed=10 + i)
        add = _strip(shape, seed=20 + i)
        for relu, extra in ((True, None), (False, add)):
            got = na.affine_act(z, mean, scale, shift, add=extra, relu=relu)
            want = na.affine_act_reference(z, mean, scale, shift, add=extra, relu=relu)
            assert got.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        y = na.affine_act_reference(z, mean, scale, shift, relu=True)
        grad_y = _strip(shape, seed=30 + i)
        for kept in (y, None):  # with the ReLU's mask, and without a ReLU
            got = na.affine_relu_backward(grad_y, kept, z, mean, scale, shift)
            want = na.affine_relu_backward_reference(grad_y, kept, z, mean, scale, shift)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
        for offset in (0.0, 1e3):  # 1e3: a mean 1e5 times the smallest channel's spread
            z = _strip(shape, offset=offset, seed=40 + i)
            n, mean, var = na.moments(z)
            exact_var, exact_mean = torch.var_mean(z.double(), dim=(0, 2, 3), correction=0)
            assert n == z.numel() // shape[1]
            torch.testing.assert_close(mean.double(), exact_mean, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(var.double(), exact_var, rtol=1e-3, atol=1e-6)


def check_tiling_norm_interpreted() -> None:
    """norm.py with kernels='triton' (the kernels, interpreted) against kernels='torch' (the
    tensor ops): NormReLU's output and every gradient, moments, the statistics' seed."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    z0 = _strip((1, 16, 24, 20), seed=1)
    bn = torch.nn.BatchNorm2d(16)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    stats = (z0.mean((0, 2, 3)), z0.var((0, 2, 3), correction=0))
    grad_y = _strip(z0.shape, seed=2)
    results = {}
    for kernels in ("triton", "torch"):
        z = z0.clone().requires_grad_()
        leaves = [z, bn.weight, bn.bias]
        y = norm.normalize(z, stats, bn, relu=True, kernels=kernels)
        results[kernels] = [y, *torch.autograd.grad(y, leaves, grad_y),
                            *norm.moments(z0, kernels)[1:],
                            norm.statistics_seed(z0, grad_y, stats[0], stats[1], stats[0],
                                                 kernels=kernels),
                            norm.statistics_seed(z0, None, stats[0], stats[1], stats[0],
                                                 kernels=kernels)]
    for got, want in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("check", ["check_kernels_interpreted", "check_tiling_norm_interpreted"])
def test_norm_act_kernels_equal_references_interpreted(check):
    run_interpreted("test_kernels_norm_act", f"{check}()")


def test_only_dense_channels_last_strips_take_the_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # norm.fused's device test passes on the CPU
    z = _strip((1, 8, 6, 5))
    assert norm.fused(z, "triton") and not norm.fused(z, "torch")
    assert not norm.fused(z.contiguous(), "triton")  # NCHW: the primitives' path
    assert not norm.fused(z.double(), "triton")  # float64: the exactness tests' tensor ops
    assert not norm.fused(z[:, :, :, 1:], "triton")  # a column crop: not dense
    with pytest.raises(ValueError, match="channels_last"):
        na.moments(z.contiguous())
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not norm.fused(z, "triton")  # a CPU tensor without the interpreter
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        na.moments(z)


def test_tile_norm_option_is_refused_where_triton_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert resolve_impl("auto", cpu, "tile:norm") == "torch"
    assert resolve_impl("torch", torch.device("cuda"), "tile:norm") == "torch"
    with pytest.raises(ConfigError, match="tile:norm=torch"):
        resolve_impl("triton", cpu, "tile:norm")
    monkeypatch.setitem(sys.modules, "triton", None)  # as if not installed
    for impl in ("triton", "auto"):
        with pytest.raises(ConfigError, match="pip install triton, or use tile:norm=torch"):
            resolve_impl(impl, torch.device("cuda"), "tile:norm")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 16, 1052, 4192), (1, 64, 530, 2096), (2, 32, 37, 129)])
def test_gpu_norm_act_kernels_equal_pytorch_primitives(shape):
    """The kernels against PyTorch's SyncBatchNorm primitives on bf16 strips of the tiled
    levels' shapes (bench_norm_kernels' cases): bf16 outputs within one bf16 rounding, float32
    moments and sums within 1e-4 relative."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import bench_norm_kernels as bench

    case = bench.strip_case(shape)
    want, got = bench.primitives(**case), bench.kernels(**case)
    for name in ("moments", "forward", "backward", "seed"):
        for g, w in zip(_outputs(got[name]()), _outputs(want[name]())):
            if torch.bfloat16 in (g.dtype, w.dtype):
                tolerance = dict(rtol=1.6e-2, atol=1e-2)  # one bf16 rounding
            else:  # the moments (values near 1), the backward's sums over 1e5-1e7 pixels
                tolerance = dict(rtol=1e-4, atol=1e-4 if name == "moments" else 1e-2)
            torch.testing.assert_close(g.float(), w.float(), **tolerance,
                                       msg=lambda m: f"{name}: {m}")


def _outputs(result) -> tuple:
    return (result,) if torch.is_tensor(result) else tuple(result)
