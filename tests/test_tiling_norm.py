"""The fused BatchNorm-with-given-statistics + ReLU of the tiled regions (memstudy/tiling/norm.py):
its hand-written backward equals autograd's through the composite expression, in float64
(gradcheck, and a direct comparison with a stated tolerance), and on CUDA the SyncBatchNorm-
primitive path (tile:norm=torch) equals the reference formulas (the Triton kernels against the
primitives: tests/test_kernels_norm_act.py)."""
from __future__ import annotations

import pytest
import torch

from memstudy.tiling.norm import NormReLU, moments, statistics_seed


def _inputs(dtype=torch.float64, device="cpu", channels=3):
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2, channels, 5, 7, generator=gen, dtype=torch.float64)
    mean = torch.randn(channels, generator=gen, dtype=torch.float64) * 0.1
    invstd = torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5
    weight = torch.randn(channels, generator=gen, dtype=torch.float64)
    bias = torch.randn(channels, generator=gen, dtype=torch.float64) * 0.1
    z = z.to(dtype=dtype, device=device)
    return [z] + [t.to(device=device, dtype=torch.promote_types(dtype, torch.float32))
                  for t in (mean, invstd, weight, bias)]


def _composite(z, mean, invstd, weight, bias, relu):
    y = (z - mean[:, None, None]) * (invstd * weight)[:, None, None] + bias[:, None, None]
    return y.relu() if relu else y


@pytest.mark.parametrize("relu", [True, False])
def test_backward_equals_autograd_of_the_composite(relu):
    leaves = [t.requires_grad_() for t in _inputs()]
    assert torch.autograd.gradcheck(lambda *a: NormReLU.apply(*a, relu, "torch"), leaves)
    grad_y = torch.randn_like(leaves[0])
    fused = torch.autograd.grad(NormReLU.apply(*leaves, relu, "torch"), leaves, grad_y)
    plain = torch.autograd.grad(_composite(*leaves, relu), leaves, grad_y)
    for got, want in zip(fused, plain):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_moments_are_the_biased_variance_and_mean():
    z = _inputs()[0]
    n, mean, var = moments(z)
    assert n == 2 * 5 * 7
    assert torch.allclose(mean, z.mean((0, 2, 3)))
    assert torch.allclose(var, z.var((0, 2, 3), correction=0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_primitives_equal_the_reference(dtype):
    """CUDA path (SyncBatchNorm primitives, channels_last) against the reference formulas run
    on the CPU from the same values: bf16 outputs within one bf16 rounding (rel 1e-2), float32
    within 1e-5; moments within 1e-5."""
    kernels = "torch"
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    cpu = [t.requires_grad_() for t in _inputs(dtype, channels=16)]
    gpu = [t.detach().cuda().requires_grad_() for t in cpu]
    gpu[0] = gpu[0].detach().to(memory_format=torch.channels_last).requires_grad_()
    grad_y = torch.randn_like(cpu[0])
    y_cpu = NormReLU.apply(*cpu, True, "torch")
    y_gpu = NormReLU.apply(*gpu, True, kernels)
    got = torch.autograd.grad(y_gpu, gpu, grad_y.cuda())
    want = torch.autograd.grad(y_cpu, cpu, grad_y)
    for a, b in zip((y_gpu, *got), (y_cpu, *want)):
        a, b = a.detach().cpu().double(), b.detach().double()
        assert (a - b).norm() <= tol * b.norm() + 1e-6
    for a, b in zip(moments(gpu[0].detach(), kernels)[1:], moments(cpu[0].detach())[1:]):
        assert torch.allclose(a.cpu().double(), b.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_rows", [True, False])
def test_gpu_statistics_seed_equals_the_reference(dtype, with_rows):
    """The statistics' gradient seed (one primitive kernel on CUDA) against the reference
    formula on the CPU, from the same values: within one rounding of dtype."""
    kernels = "torch"
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    z, mean, scale, shift, _ = _inputs(dtype, channels=16)
    rows = torch.randn_like(z) if with_rows else None
    want = statistics_seed(z, rows, mean, scale, shift)
    on_gpu = [t.cuda() for t in (mean, scale, shift)]
    z_gpu = z.cuda().to(memory_format=torch.channels_last)
    got = statistics_seed(z_gpu, None if rows is None else rows.cuda(), *on_gpu, kernels=kernels)
    assert got.dtype == dtype
    got, want = got.cpu().double(), want.double()
    assert (got - want).norm() <= tol * want.norm() + 1e-6
