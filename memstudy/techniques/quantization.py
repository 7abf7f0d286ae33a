"""quantization: quantization-aware training (QAT) with fake-quantized weights and activations.

What it is: PyTorch eager-mode QAT (`torch.ao.quantization.prepare_qat`) with the backend's
default QAT qconfig. Every convolution (except the segmentation head) becomes a QAT
convolution whose weight passes through an 8-bit per-channel (x86 / fbgemm) or per-tensor
(qnnpack) fake quantizer, and the outputs of convolutions, BatchNorm and ReLU layers pass
through 8-bit per-tensor activation fake quantizers (moving-average min/max observers). The
model still computes in float: fake quantization rounds values to the 8-bit grid and back.

Memory / compute trade-off, honestly: QAT does NOT save training memory. Weights, gradients
and optimizer state stay float32; each convolution saves its fake-quantized weight copy for
backward (a second copy of all conv weights, ~93 MiB for ResNet-34 U-Net) and every fake
quantizer saves a boolean mask (1 byte per element) for its straight-through gradient. The
activations themselves are the same size. So saved-for-backward bytes rise: measured on the
CPU at 1 x 192 x 192 px, 52 MiB -> 178 MiB (docs/techniques/quantization.md); the weight copy
is constant, so the relative increase shrinks at larger images. Compute: one extra elementwise
pass per quantized tensor plus the observers. What QAT buys is a model that keeps its quality
when later converted to int8 for inference (4x smaller weights, int8 kernels) - the source
study lists it among the memory techniques, and this module lets the harness measure its cost.

Choices:
- The head (last conv + sigmoid) stays float (`qconfig=None`): 8-bit logits would quantise the
  enhanced image itself to <= 256 levels, which MS-SSIM on 16-bit radiographs would punish.
  The input image is not fake-quantized either (no QuantStub: the model's interface stays
  float), and the decoder's interpolation / concatenation are functional ops eager QAT cannot
  observe. Modules are not fused (conv+bn+relu), so BatchNorm keeps its own statistics.
- Autocast: PyTorch's fused fake-quantize kernel accepts only float32. Under `amp:bf16` /
  `amp:fp16` the activation quantizers get 16-bit tensors, so each is wrapped to quantize in
  float32 and hand back the original dtype (`Float32FakeQuantize`); the cast is transient.
- `freeze_after`: after that many optimizer steps the observers stop updating, so scales are
  fixed for the rest of training (the usual QAT schedule). 0 keeps them updating.
"""
from __future__ import annotations

import warnings
import torch
from torch import nn
from torch.ao import quantization as tq

from memstudy.errors import ConfigError
from memstudy.runtime import StepInfo
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import QuantizationOptions as Options


class Float32FakeQuantize(nn.Module):
    """A fake quantizer that also accepts 16-bit input (autocast): it quantizes in float32."""

    def __init__(self, inner: tq.FakeQuantizeBase):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return self.inner(x)
        return self.inner(x.float()).to(x.dtype)


def qat_qconfig(backend: str) -> tq.QConfig:
    default = tq.get_default_qat_qconfig(backend)
    return tq.QConfig(activation=lambda: Float32FakeQuantize(default.activation()),
                      weight=default.weight)


def prepare(model: nn.Module, backend: str) -> nn.Module:
    """Swap in QAT modules and fake quantizers, in place (the head stays float)."""
    model.train()
    model.qconfig = qat_qconfig(backend)
    model.head.qconfig = None
    with warnings.catch_warnings():
        # torch.ao's eager QAT warns that it will move to torchao, and about its own
        # reduce_range default; neither changes what is computed here.
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.simplefilter("ignore", category=UserWarning)
        tq.prepare_qat(model, inplace=True)
    return model


def fake_quantizers(model: nn.Module) -> list[tq.FakeQuantizeBase]:
    return [m for m in model.modules() if isinstance(m, tq.FakeQuantizeBase)]


def check(opts: Options, plan: Plan) -> None:
    if opts.freeze_after < 0:
        raise ConfigError(f"quantization: freeze_after={opts.freeze_after} must be >= 0 "
                          "(0 = observers never frozen)")


def apply(opts: Options, build: Build) -> None:
    model = build.model
    if not hasattr(model, "head"):
        raise ConfigError("quantization: the model exposes no segmentation head to keep float; "
                          "drop quantization")
    prepare(model, opts.backend)
    quantizers = fake_quantizers(model)
    build.notes["fake_quantizers"] = len(quantizers)
    if opts.freeze_after:
        build.runtime.step_hooks.append(_freezer(model, opts.freeze_after))


def _freezer(model: nn.Module, after: int):
    def freeze(info: StepInfo) -> None:
        if info.step == after:
            model.apply(tq.disable_observer)

    return freeze


register(Technique("quantization", Stage.STRUCTURE, Options,
                   "QAT fake-quantized weights/activations: float32 kept, saved bytes rise",
                   apply, check, order=30,
                   needs_unet="leaves the U-Net's segmentation head in float32"))  # after the other module swaps: quantizes the final convs
