"""memstudy's U-Net against segmentation-models-pytorch's: the decoder block that up-samples in
its input's dtype (memstudy.models.unet.DecoderBlock) computes what smp's block computes."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from segmentation_models_pytorch.decoders.unet.decoder import UnetDecoderBlock
from torch.overrides import TorchFunctionMode

from memstudy.errors import MemstudyError
from memstudy.models import build_unet
from memstudy.models.unet import DecoderBlock


def _smp_twin(model):
    """A copy of `model` whose decoder blocks run smp's own forward."""
    twin = copy.deepcopy(model)
    for block in twin.decoder.blocks:
        block.__class__ = UnetDecoderBlock
    return twin


def _step(model, x):
    out = model(x)
    out.square().mean().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_every_decoder_block_is_memstudys():
    assert all(type(b) is DecoderBlock for b in build_unet(seed=0).decoder.blocks)


def test_float64_output_and_gradients_equal_smps_block():
    model = build_unet(seed=0).double()
    x = torch.rand(1, 1, 96, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out, grads = _step(model, x)
    ref_out, ref_grads = _step(_smp_twin(model), x)
    assert torch.equal(out, ref_out)
    for name, ref in ref_grads.items():
        assert torch.equal(grads[name], ref), name


def test_folded_up_sampling_equals_smps_block_in_float64():
    """fold_upsampling (tile:stream's untiled blocks): the folded up-convolution sums the same
    products in another order; every block of the U-Net folded, output and every gradient
    within 1e-12 of smp's, and no nearest up-sampling called."""
    model = build_unet(seed=0).double()
    x = torch.rand(1, 1, 96, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref_out, ref_grads = _step(_smp_twin(model), x)
    for block in model.decoder.blocks:
        block.fold_upsampling = True
    with _AutocastAtInterpolate() as calls:
        out, grads = _step(model, x)
    assert calls.seen == []
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-12, atol=1e-12, msg=name)


class _AutocastAtInterpolate(TorchFunctionMode):
    """Whether autocast was on at each nearest up-sampling."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.interpolate:
            self.seen.append(torch.is_autocast_enabled("cpu"))
        return func(*args, **(kwargs or {}))


def test_the_up_sampling_runs_outside_autocast():
    """CPU autocast keeps upsample_nearest2d in bf16 anyway; what CUDA's list would promote is
    the call made under autocast, so the test checks autocast is off at every up-sampling."""
    model = build_unet(seed=0)
    mode = _AutocastAtInterpolate()
    with torch.autocast("cpu", dtype=torch.bfloat16), mode:
        model(torch.rand(1, 1, 64, 64))
    assert mode.seen == [False] * len(model.decoder.blocks)


@pytest.mark.parametrize("forward", [UnetDecoderBlock.forward, lambda self, x, skip=None: x])
def test_a_changed_smp_block_is_refused_by_name(monkeypatch, forward):
    """Another class, or smp's class with an older forward (x, skip): refused, naming the fix."""
    import segmentation_models_pytorch.decoders.unet.decoder as smp_decoder

    class Newer(UnetDecoderBlock):
        pass

    Newer.forward = forward
    monkeypatch.setattr(smp_decoder, "UnetDecoderBlock", Newer)
    with pytest.raises(MemstudyError, match="decoder block is Newer.*install segmentation-models"):
        build_unet(seed=0)
    if forward is not UnetDecoderBlock.forward:  # the same class with an old forward
        monkeypatch.setattr(smp_decoder, "UnetDecoderBlock", UnetDecoderBlock)
        monkeypatch.setattr(UnetDecoderBlock, "forward", forward)
        with pytest.raises(MemstudyError, match=r"UnetDecoderBlock\('self', 'x', 'skip'\)"):
            build_unet(seed=0)


@pytest.mark.gpu
def test_gpu_bf16_autocast_keeps_the_decoder_in_bf16_with_smps_gradients():
    """Under CUDA bf16 autocast smp's block concatenates in float32 (autocast promotes the
    up-sampling); memstudy's in bf16, with the same output and gradients: bitwise, or within one
    bf16 rounding where the up-sampling's backward sums in another order (stated tolerance
    1e-2 relative, per tensor)."""
    device = torch.device("cuda")
    model = build_unet(seed=0).to(device)
    twin = _smp_twin(model)
    x = torch.rand(1, 1, 256, 256, device=device, generator=torch.Generator(device).manual_seed(0))
    cats = []
    hook = lambda m, args, out: cats.append(args[0].dtype)  # noqa: E731 - conv1's input
    both = (*model.decoder.blocks, *twin.decoder.blocks)
    handles = [b.conv1.register_forward_hook(hook) for b in both]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, grads = _step(model, x)
        ref_out, ref_grads = _step(twin, x)
    for h in handles:
        h.remove()
    blocks = len(model.decoder.blocks)
    assert cats[:blocks] == [torch.bfloat16] * blocks
    assert torch.float32 in cats[blocks:]  # smp's, promoted: what the change removes
    assert torch.equal(out, ref_out)
    for name, ref in ref_grads.items():
        error = (grads[name].float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)
        assert error <= 1e-2, f"{name}: relative error {error:.3g}"
