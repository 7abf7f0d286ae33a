"""Triton kernels against their PyTorch references: on the CPU through TRITON_INTERPRET=1,
on a GPU compiled (marked gpu)."""
from __future__ import annotations

import os

import pytest
import torch

from memstudy.techniques.tri_accel.grad_stats import (flatten, make_layout, segment_stats,
                                                   segment_stats_reference)
from helpers import run_interpreted

# one element, exactly one tile, one tile + 1, several tiles, a small tail
SIZES = [1, 7, 4096, 4097, 12000, 3]


def _segments(sizes: list[int], offset: float, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * (i + 1) * 1e-3 + offset for i, n in enumerate(sizes)]


def _exact(segments: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.stack([s.double().mean() for s in segments])
    var = torch.stack([s.double().var(correction=0) for s in segments])
    return mean, var


def check_interpreted(offset: float) -> None:
    """The kernel under the interpreter vs the reference and float64 (run in a child process)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    segments = _segments(SIZES, offset)
    flat = flatten(segments)
    layout = make_layout(SIZES, tile=4096)  # small tiles: segments span several of them
    mean, var = segment_stats(flat, layout)
    ref_mean, ref_var = segment_stats_reference(flat, layout.offsets.tolist())
    torch.testing.assert_close(mean, ref_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(var, ref_var, rtol=1e-4, atol=1e-12)
    exact_mean, exact_var = _exact(segments)  # and both against float64
    torch.testing.assert_close(var.double(), exact_var, rtol=1e-3, atol=1e-12)
    torch.testing.assert_close(mean.double(), exact_mean, rtol=1e-6, atol=1e-6)
    assert var[0] == 0  # one element: no spread


@pytest.mark.parametrize("offset", [0.0, 100.0])  # 100: a mean 1e5 times the spread
def test_grad_stats_kernel_equals_reference_interpreted(offset):
    run_interpreted("test_kernels", f"check_interpreted({offset})")


def test_layout_tiles_never_straddle_segments():
    layout = make_layout([5, 10], tile=4)
    assert layout.offsets.tolist() == [0, 5, 15]
    assert layout.tile_start.tolist() == [0, 4, 5, 9, 13]
    assert layout.tile_len.tolist() == [4, 1, 4, 4, 2]
    assert layout.seg_tiles.tolist() == [0, 2, 5]
    with pytest.raises(ValueError, match="at least one element"):
        make_layout([3, 0])


def test_kernel_refuses_cpu_tensor_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        segment_stats(torch.ones(4), make_layout([4]))


@pytest.mark.gpu
def test_grad_stats_kernel_equals_reference_on_gpu():
    sizes = [1, 9408, 36864, 2359296, 16, 1_000_003]
    flat = flatten(_segments(sizes, 0.5)).cuda()
    layout = make_layout(sizes, flat.device)
    mean, var = segment_stats(flat, layout)
    ref_mean, ref_var = segment_stats_reference(flat, layout.offsets.tolist())
    torch.testing.assert_close(mean, ref_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(var, ref_var, rtol=1e-4, atol=1e-12)
