"""invertible under float16 autocast (amp:fp16): the velocity must not enter momentumnet in float16.

momentumnet keeps the velocity in fixed point, int64(v * 2**52), computed in v's own dtype. A
float16 run input (a float16 convolution's output under autocast) made v float16, every nonzero
v * 2**52 became inf and its int64 conversion saturated: the first block of each run added
|v| = 2048 to every activation, and the float16 convolutions of the blocks after it overflowed
(docs/paper.md, "Why AMP with Momentum-Net diverges"). The fix (invertible.velocity_input) lets
the run's input enter in float32; the convolutions still run in float16 under autocast.
"""
import copy

import pytest
import torch
from momentumnet.exact_rep_pytorch import TorchExactRep
from torch import nn
from torchvision.models.resnet import BasicBlock

from memstudy.techniques import invertible
from memstudy.techniques.invertible import MomentumBlocks

CHANNELS, SIZE, BLOCKS = 16, 8, 5  # layer3's run length (5 blocks), small maps: fast on the CPU
WEIGHT_SCALE = 20.0  # trained weights grow; this puts the unfixed path's convolutions past 65504


def _blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    blocks = [BasicBlock(CHANNELS, CHANNELS) for _ in range(BLOCKS)]
    with torch.no_grad():
        for block in blocks:
            for m in block.modules():
                if isinstance(m, nn.Conv2d):
                    m.weight.mul_(WEIGHT_SCALE)
    return blocks


def _x() -> torch.Tensor:
    # what a run receives: a ReLU'd feature map
    generator = torch.Generator().manual_seed(0)
    return torch.relu(torch.randn(1, CHANNELS, SIZE, SIZE, generator=generator))


def _run(blocks, fp16: bool):
    """Memory-saving run: output, parameter gradients and input gradient of sum(out * w), and
    the largest |output| of a convolution in the forward."""
    module = MomentumBlocks(copy.deepcopy(blocks), 0.9, memory_saving=True)
    conv_max = [0.0]

    def record(m, args, out):
        conv_max[0] = max(conv_max[0], float(out.detach().abs().max().float()))
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_hook(record)
    x = (_x().half() if fp16 else _x()).requires_grad_()
    w = torch.randn(1, CHANNELS, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        out = module(x)
    forward_conv_max = conv_max[0]  # before the backward's rebuild runs the blocks again
    (out.float() * w).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in module.parameters()])
    return out.detach().float(), grads, x.grad.float(), forward_conv_max


@pytest.fixture(scope="module")
def float32_reference():
    return _run(_blocks(), fp16=False)


def test_momentumnet_fixed_point_saturates_on_a_float16_velocity():
    """The cause: 0.01 * 2**52 is inf in float16; int64(inf) is out of range (-2**63 on an x86
    CPU, 2**63 - 1 on a CUDA GPU), i.e. |v| = 2048 instead of 0.01. float32 holds it exactly."""
    for dtype, expected in ((torch.float16, 2048.0), (torch.float32, 0.01)):
        v = TorchExactRep(torch.zeros(4, dtype=dtype))
        v += torch.full((4,), 0.01, dtype=dtype)
        assert torch.allclose(v.val.abs(), torch.full((4,), expected), rtol=1e-3), (dtype, v.val)


def test_unfixed_float16_run_overflows(monkeypatch, float32_reference):
    """Before the fix (the run's input kept in float16): the velocity saturates at 2048, the
    activations of the later blocks reach thousands and a float16 convolution overflows to inf.
    (The run's output itself stays finite: the int64 fixed point turns the NaN that BatchNorm
    makes of inf into 2048 again; the gradients are NaN.)"""
    monkeypatch.setattr(invertible, "velocity_input", lambda x: x)
    out, grads, _, conv_max = _run(_blocks(), fp16=True)
    assert conv_max == float("inf")
    assert (out - float32_reference[0]).abs().max() > 1000
    assert not torch.isfinite(grads).all()


def test_fixed_float16_run_is_finite_and_matches_float32(float32_reference):
    """With the fix the float16-autocast run stays finite and computes the float32 run's output
    to float16 rounding: measured 1.9e-3 (output, max abs; |out| up to 4.4), gradients 2.7e-2
    (parameters) and 3.3e-2 (input) relative; the unfixed run is off by thousands, NaN
    gradients."""
    ref_out, ref_grads, ref_xgrad, ref_conv_max = float32_reference
    out, grads, xgrad, conv_max = _run(_blocks(), fp16=True)
    assert torch.isfinite(out).all() and torch.isfinite(grads).all()
    assert conv_max < 1000 and conv_max == pytest.approx(ref_conv_max, rel=0.01)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0.05)
    assert (grads - ref_grads).norm() / ref_grads.norm() < 0.1
    assert (xgrad - ref_xgrad).norm() / ref_xgrad.norm() < 0.1


def test_velocity_input_only_widens_float16():
    """bfloat16 has float32's exponent (no overflow): its runs are left as they were."""
    assert invertible.velocity_input(torch.zeros(1, dtype=torch.float16)).dtype == torch.float32
    for dtype in (torch.bfloat16, torch.float32):
        assert invertible.velocity_input(torch.zeros(1, dtype=dtype)).dtype == dtype
