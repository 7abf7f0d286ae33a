"""Activation-compression kernels against their PyTorch references (TRITON_INTERPRET=1 on the
CPU, compiled on a GPU), and the quantiser's guarantees: one-step error bound, unbiasedness."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memstudy.kernels import quantize as qk

# a tail shorter than a byte, a tail inside a group, whole groups, several programs' worth
SIZES = [5, 37, 1024, 4096 + 300]
CASES = [(8, 32), (4, 256), (2, 64), (2, 4096)]


def _data(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3 + 1
    x[: n // 7] = 0.25  # a constant run: groups with scale 0 are restored exactly
    return x.to(dtype)


def check_interpreted() -> None:
    """Each kernel under the interpreter equals its reference bit for bit (child process)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for bits, group in CASES:
        for n in SIZES:
            for dtype in (torch.float32, torch.bfloat16):
                x, seed = _data(n, dtype, n), 1000 + n
                codes, lo, scale = qk.quantize(x, bits, group, seed)
                ref = qk.quantize_reference(x, bits, group, qk.uniform_noise(n, seed, "cpu"))
                for got, want in zip((codes, lo, scale), ref):
                    assert torch.equal(got, want), (bits, group, n, dtype)
                out = qk.dequantize(codes, lo, scale, n, bits, group, dtype)
                want = qk.dequantize_reference(codes, lo, scale, n, bits, group, dtype)
                assert out.dtype == dtype and torch.equal(out, want), (bits, group, n, dtype)
    for n in (1, 8, 13, 9000):
        x = _data(n, torch.float32) - 1
        signs = qk.pack_signs(x)
        assert torch.equal(signs, qk.pack_signs_reference(x)), n
        grad = _data(n, torch.float32, seed=1)
        assert torch.equal(qk.apply_signs(grad, signs), qk.apply_signs_reference(grad, signs)), n
    noise = qk.uniform_noise(100_000, 7, "cpu")  # Triton's Philox stream: U[0, 1)
    assert 0 <= float(noise.min()) and float(noise.max()) < 1
    assert abs(float(noise.mean()) - 0.5) < 0.005 and abs(float(noise.var()) - 1 / 12) < 0.002
    assert not torch.equal(noise, qk.uniform_noise(100_000, 8, "cpu"))  # the seed matters


def test_kernels_equal_references_interpreted():
    # A child process: TRITON_INTERPRET must be set before triton is first imported.
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import test_kernels_quantize as t; t.check_interpreted()")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("bits,group", CASES)
def test_round_trip_within_one_step_per_group(bits, group):
    n = 4096 + 300
    x = _data(n, torch.float32)
    codes, lo, scale = qk.quantize_reference(x, bits, group, torch.rand(n))
    assert codes.numel() == qk.code_bytes(n, bits, group) == qk.n_groups(n, group) * group * bits // 8
    restored = qk.dequantize_reference(codes, lo, scale, n, bits, group, torch.float32)
    step = scale.repeat_interleave(group)[:n]
    err = (restored - x).abs()
    # one quantisation step, plus float32 rounding of lo + code * step
    assert bool((err <= step + 1e-6 * (x.abs() + 1)).all()), float((err - step).max())
    constant = step == 0
    assert constant.any() or group > n // 7  # some group lies inside the constant run
    assert torch.equal(restored[constant], x[constant])
    torch.testing.assert_close(lo, torch.stack([c.min() for c in x.split(group)]))


def test_stochastic_rounding_is_unbiased():
    """Mean of D restorations -> x: each element's error is a Bernoulli of one step, so its mean
    over D draws has standard deviation <= step / (2 sqrt(D)); allowed: 5 of them."""
    bits, group, draws, n = 2, 64, 4000, 512
    x = _data(n, torch.float32)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(draws):
        codes, lo, scale = qk.quantize_reference(x, bits, group, torch.rand(n))
        total += qk.dequantize_reference(codes, lo, scale, n, bits, group, torch.float32).double()
    step = scale.repeat_interleave(group)[:n].double()
    bias = (total / draws - x.double()).abs()
    assert bool((bias <= 5 * step / (2 * draws ** 0.5) + 1e-6).all()), float((bias / step).max())
    # round-to-nearest (u = 0.5 everywhere) is biased: the test can tell the difference
    codes, lo, scale = qk.quantize_reference(x, bits, group, torch.full((n,), 0.5))
    nearest = qk.dequantize_reference(codes, lo, scale, n, bits, group, torch.float32).double()
    assert float(((nearest - x.double()).abs() / step.clamp_min(1e-12)).max()) > 0.2


def test_kernels_refuse_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        qk.quantize(torch.ones(64), 4, 32, 0)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        qk.pack_signs(torch.ones(64))


@pytest.mark.gpu
def test_kernels_equal_references_on_gpu():
    """Compiled: FMA contraction may move a code by one level where (x - lo) / step + u lies
    within an ulp of an integer; allowed on at most 1e-4 of the elements."""
    n, seed = 3_000_001, 11
    for bits, group in CASES:
        x = _data(n, torch.float32).cuda()
        codes, lo, scale = qk.quantize(x, bits, group, seed)
        ref = qk.quantize_reference(x, bits, group, qk.uniform_noise(n, seed, "cuda"))
        torch.testing.assert_close(lo, ref[1], rtol=0, atol=0)
        # (hi - lo) / levels: the compiled division may round one ulp away (seen on an H100)
        torch.testing.assert_close(scale, ref[2], rtol=2.5e-7, atol=0)
        got = qk.dequantize(codes, lo, scale, n, bits, group, torch.float32)
        want = qk.dequantize_reference(ref[0], lo, scale, n, bits, group, torch.float32)
        step = scale.repeat_interleave(group)[:n]
        moved = (got - want).abs() > 1e-6 * (want.abs() + 1)
        assert float(moved.float().mean()) <= 1e-4
        assert bool(((got - want).abs() <= step * 1.0001 + 1e-6).all())
        signs = qk.pack_signs(x - 1)
        assert torch.equal(signs, qk.pack_signs_reference(x - 1))
        assert torch.equal(qk.apply_signs(x, signs), qk.apply_signs_reference(x, signs))
