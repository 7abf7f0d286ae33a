"""Activation-compression kernels against their PyTorch references (TRITON_INTERPRET=1 on the
CPU, compiled on a GPU), and the quantiser's guarantees: one-step error bound, unbiasedness;
for memory-order groups and for the channel-major groups of channels-last tensors."""
from __future__ import annotations

import os
import random

import pytest
import torch

import memstudy.techniques.compress.quantize as qk
from memstudy.techniques.compress.codec import Compressor
from helpers import run_interpreted

# a tail shorter than a byte, a tail inside a group, whole groups, several programs' worth
SIZES = [5, 37, 1024, 4096 + 300]
CASES = [(8, 32), (4, 256), (2, 64), (2, 4096)]
# channels-last [N, C, H, W]: P = N H W pixels. (2, 40, 9, 15): P = 270, a short last group at
# every group size, C = 40 a partial channel block (BLOCK_C 16 at groups of 256, 8 at 4096, 64
# at 32 and 64); (1, 3, 7, 5): fewer pixels than a group, 3 channels; (1, 32, 16, 16): whole
# groups (but at 4096) and whole blocks
CL_SHAPES = [(2, 40, 9, 15), (1, 3, 7, 5), (1, 32, 16, 16)]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _data(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3 + 1
    x[: n // 7] = 0.25  # a constant run: groups with scale 0 are restored exactly
    return x.to(dtype)


def _channels_last(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Channels of very different ranges and offsets (as in a network), channel 1 constant."""
    g = torch.Generator().manual_seed(seed)
    n, c, h, w = shape
    spread = 10.0 ** torch.linspace(-3, 2, c).view(1, c, 1, 1)
    x = torch.randn(shape, generator=g) * spread + torch.linspace(-5, 5, c).view(1, c, 1, 1)
    if c > 1:
        x[:, 1] = 0.25
    return x.to(dtype).contiguous(memory_format=torch.channels_last)


def _memory(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory as a 1-D view (what compress hands the kernels)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def check_channels_interpreted() -> None:
    """The channel-major kernels under the interpreter equal their references bit for bit
    (child process). Each case meets every shape and every dtype, with the dtype rotating (the
    interpreter is slow: 12 combinations, not 36)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for i, (bits, group) in enumerate(CASES):
        for k, shape in enumerate(CL_SHAPES):
            dtype = DTYPES[(i + k) % len(DTYPES)]
            x = _channels_last(shape, dtype, seed=bits + group)
            flat, c, n, seed = _memory(x), shape[1], x.numel(), 17 + group
            codes, lo, scale = qk.quantize_channels(flat, c, bits, group, seed)
            ref = qk.quantize_channels_reference(flat, c, bits, group,
                                                 qk.uniform_noise(n, seed, "cpu"))
            case = (bits, group, shape, dtype)
            for got, want in zip((codes, lo, scale), ref):
                assert torch.equal(got, want), case
            assert codes.numel() == qk.channel_code_bytes(n, c, bits), case
            out = torch.empty_like(x)  # channels-last: written in place, in memory order
            qk.dequantize_channels(codes, lo, scale, n, c, bits, group, dtype, out=_memory(out))
            want = qk.dequantize_channels_reference(codes, lo, scale, n, c, bits, group, dtype)
            assert torch.equal(_memory(out), want), case
            assert qk.dequantize_channels(codes, lo, scale, n, c, bits, group,
                                          dtype).dtype == dtype
    # compress itself: channels-last activations take the channel-major kernels, restored with
    # their strides; contiguous ones the memory-order kernels
    x = _channels_last((2, 40, 9, 15), torch.bfloat16)
    comp = Compressor(bits=4, group=64, min_numel=0, use_triton=True, seed=5)
    q = comp.quantize(x)
    seed = random.Random(5).getrandbits(31)
    ref = qk.quantize_channels_reference(_memory(x), 40, 4, 64,
                                         qk.uniform_noise(x.numel(), seed, "cpu"))
    assert q.channels == 40 and all(torch.equal(a, b) for a, b in zip(q.tensors(), ref))
    restored = comp.dequantize(q)
    assert restored.stride() == x.stride() and restored.dtype == x.dtype
    assert torch.equal(_memory(restored), qk.dequantize_channels_reference(
        *ref, x.numel(), 40, 4, 64, torch.bfloat16))
    assert comp.quantize(x.contiguous()).channels == 0


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


@pytest.mark.parametrize("check", ["check_interpreted", "check_channels_interpreted"])
def test_kernels_equal_references_interpreted(check):
    run_interpreted("test_kernels_quantize", f"{check}()")


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


def _channel_steps(scale: torch.Tensor, pixels: int, channels: int, group: int) -> torch.Tensor:
    """[P, C]: the step (or lo) of each element's channel-major group (stored [G, C])."""
    return scale.view(-1, channels).repeat_interleave(group, dim=0)[:pixels]


@pytest.mark.parametrize("bits,group", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channel_major_round_trip_within_one_step_per_channel_group(bits, group, dtype):
    shape = (2, 40, 9, 15)
    x = _channels_last(shape, dtype)
    pixels, c = x.numel() // shape[1], shape[1]
    flat = _memory(x)
    codes, lo, scale = qk.quantize_channels_reference(flat, c, bits, group, torch.rand(x.numel()))
    groups = c * qk.n_groups(pixels, group)
    assert qk.channel_groups(x.numel(), c, group) == groups
    assert lo.numel() == scale.numel() == groups  # C * ceil(P / group) groups, none wider
    # ceil(P * bits / 8) bytes per channel: a short last group's bytes are not padded to a group
    assert codes.numel() == qk.channel_code_bytes(x.numel(), c, bits) == c * -(-pixels * bits // 8)
    restored = qk.dequantize_channels_reference(codes, lo, scale, x.numel(), c, bits, group, dtype)
    # [P, C] views of memory: row p is pixel p (n, h, w), column c channel c
    xs, back = flat.float().view(pixels, c), restored.float().view(pixels, c)
    step = _channel_steps(scale, pixels, c, group)
    rounding = xs.abs() * (2 ** -8 if dtype == torch.bfloat16 else 1e-6)  # restored in dtype
    err = (back - xs).abs()
    assert bool((err <= step + rounding + 1e-6).all()), float((err - step - rounding).max())
    assert bool((step[:, 1] == 0).all()) and torch.equal(back[:, 1], xs[:, 1])  # constant channel
    # lo of group g of channel c: the minimum of pixels [g group, (g + 1) group) of channel c
    want_lo = torch.stack([col.min() for col in xs.t()[5].split(group)])
    torch.testing.assert_close(lo.view(-1, c)[:, 5], want_lo, rtol=0, atol=0)
    # per-channel steps: the widest group step is the widest channel's, not the whole tensor's
    widest = (xs.amax(0) - xs.amin(0)) / ((1 << bits) - 1)
    assert bool((step <= widest + 1e-6).all())


def test_channel_major_groups_track_each_channels_range():
    """A small-range channel next to large ones keeps a small step (memory-order groups would
    give it the large channels' step): the reason for channel-major groups."""
    x = _channels_last((1, 64, 32, 32), torch.float32)
    flat, n, c = _memory(x), x.numel(), 64
    noise = torch.rand(n, generator=torch.Generator().manual_seed(0))
    parts = qk.quantize_channels_reference(flat, c, 4, 256, noise)
    cm = qk.dequantize_channels_reference(*parts, n, c, 4, 256, torch.float32)
    parts = qk.quantize_reference(flat, 4, 256, noise)
    mo = qk.dequantize_reference(*parts, n, 4, 256, torch.float32)
    small = slice(0, 8)  # channels of spread 1e-3 .. 5e-3
    error = [(r.view(-1, c)[:, small] - flat.view(-1, c)[:, small]).abs().mean() for r in (cm, mo)]
    assert error[0] < error[1] / 100, error


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_channel_kernels_equal_references_on_gpu(dtype):
    """As below, for the channel-major kernels on a channels-last activation-like tensor.
    Codes: at most 1e-4 of the elements a level apart (FMA contraction, as below). Restored
    values of the same codes: within the rounding of one fused multiply-add, 2 eps (|x'| +
    |lo|) with eps = 2^-23: channels here span 1e-3 .. 1e2 around offsets of +-5, so a value
    near 0 restored from lo ~ -300 differs from the two-rounding reference by ulps of 300,
    above any bound relative to the value itself (H100, 2026-11-23: 0.26% of elements past
    1e-6 (|x'| + 1))."""
    shape, seed = (4, 96, 61, 67), 11  # P = 16348: short last groups; C = 96
    x = _channels_last(shape, dtype).cuda()
    flat, n, c = _memory(x), x.numel(), shape[1]
    pixels = n // c
    for bits, group in CASES:
        codes, lo, scale = qk.quantize_channels(flat, c, bits, group, seed)
        ref = qk.quantize_channels_reference(flat, c, bits, group,
                                             qk.uniform_noise(n, seed, "cuda"))
        torch.testing.assert_close(lo, ref[1], rtol=0, atol=0)
        torch.testing.assert_close(scale, ref[2], rtol=2.5e-7, atol=0)
        differing_bytes = float((codes != ref[0]).float().mean())
        assert differing_bytes <= 1e-4 * (8 // bits), (bits, group, differing_bytes)
        want = qk.dequantize_channels_reference(ref[0], lo, scale, n, c, bits, group,
                                                torch.float32)
        same_codes = qk.dequantize_channels(ref[0], lo, scale, n, c, bits, group, torch.float32)
        lo_each = _channel_steps(lo, pixels, c, group).reshape(-1)
        fma = 2 * 2.0 ** -23 * (want.abs() + lo_each.abs())
        assert bool(((same_codes - want).abs() <= fma).all()), (bits, group)
        got = qk.dequantize_channels(codes, lo, scale, n, c, bits, group, torch.float32)
        step = _channel_steps(scale, pixels, c, group).reshape(-1)
        assert bool(((got - want).abs() <= step * 1.0001 + fma).all()), (bits, group)
        out = torch.empty_like(x)
        qk.dequantize_channels(codes, lo, scale, n, c, bits, group, dtype, out=_memory(out))
        assert torch.equal(_memory(out), got.to(dtype)), (bits, group)


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


def test_the_random_seed_is_never_a_specialisation():
    """Triton compiles a variant per integer argument's divisibility by 16; a kernel that
    specialised on its per-call random seed would compile new variants inside timed steps
    long after warm-up. Built without the interpreter (no GPU needed to build)."""
    kernels = qk._kernels(False)
    seeded = {name: k for name, k in kernels.items() if "seed" in k.arg_names}
    assert set(seeded) == {"quantize", "quantize_channels", "uniform"}
    for name, kernel in seeded.items():
        seed = next(p for p in kernel.params if p.name == "seed")
        assert seed.do_not_specialize, name
