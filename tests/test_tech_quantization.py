"""quantization (eager QAT): fake quantizers inserted, bounded error, gradients, memory, AMP."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.nn.qat import Conv2d as QATConv2d

from memstudy.errors import ConfigError
from memstudy.models import build_unet
from memstudy.runtime import StepInfo
from memstudy.techniques import get_technique
from memstudy.techniques.compose import build_pipeline, make_plan
from memstudy.techniques.quantization import fake_quantizers, prepare
from helpers import saved_bytes

X = torch.rand(1, 1, 96, 96, generator=torch.Generator().manual_seed(1))
Y = torch.clamp(X * 1.4 - 0.2, 0, 1)


@pytest.fixture(scope="module")
def qat():
    return prepare(build_unet(seed=0), "x86")




def test_every_conv_but_the_head_gets_weight_and_output_fake_quantizers(qat):
    convs = [m for m in qat.modules() if isinstance(m, nn.Conv2d)]
    qat_convs = [m for m in convs if isinstance(m, QATConv2d)]
    assert len(convs) == 47 and len(qat_convs) == 46
    assert all(hasattr(c, "activation_post_process") for c in qat_convs)
    assert type(qat.head[0]) is nn.Conv2d and not hasattr(qat.head[0], "activation_post_process")
    assert len(fake_quantizers(qat)) == 138  # 46 weights + 92 outputs (conv, BN, ReLU)


def test_quantization_error_is_bounded_by_half_a_step():
    conv = prepare(build_unet(seed=0), "x86").encoder.conv1
    x = torch.rand(1, 1, 64, 64, generator=torch.Generator().manual_seed(0))
    out = conv(x)  # observers see this batch, then quantize it
    fq_w = conv.weight_fake_quant
    w_step = fq_w.scale.view(-1, 1, 1, 1)
    assert ((conv.weight_fake_quant(conv.weight) - conv.weight).abs() <= w_step / 2 + 1e-7).all()
    float_out = F.conv2d(x, fq_w(conv.weight), stride=2, padding=3)
    act_step = conv.activation_post_process.inner.scale
    err = (out - float_out).abs()
    assert 0 < err.max() <= act_step / 2 + 1e-6


def test_whole_model_output_differs_but_correlates(qat):
    plain = build_unet(seed=0)(X).detach().flatten()
    quant = qat(X).detach().flatten()
    # Measured at initialisation (x86, 192 px): mean |diff| 0.078 on [0, 1], correlation 0.80;
    # an untrained U-Net is this sensitive (0.2% weight noise moves its logits by 8%).
    assert (plain - quant).abs().max() > 1e-3
    assert torch.corrcoef(torch.stack([plain, quant]))[0, 1] > 0.6


def test_one_step_trains_every_conv_weight(qat):
    opt = torch.optim.Adam(qat.parameters(), lr=1e-3)
    loss = F.mse_loss(qat(X), Y)
    loss.backward()
    convs = [m for m in qat.modules() if isinstance(m, nn.Conv2d)]
    assert all(c.weight.grad is not None and c.weight.grad.abs().sum() > 0 for c in convs)
    before = qat.encoder.conv1.weight.detach().clone()
    opt.step()
    assert torch.isfinite(loss) and not torch.equal(before, qat.encoder.conv1.weight)


def test_saves_more_for_backward_than_float():
    """Direction measured: saved bytes RISE (52 -> 178 MiB at 192 px), by about a copy of the
    conv weights (fake-quantized weights saved by each conv) plus 1-byte masks."""
    plain, quant = build_unet(seed=0), prepare(build_unet(seed=0), "x86")
    conv_weight_bytes = sum(m.weight.nbytes for m in quant.modules() if isinstance(m, QATConv2d))
    before, after = saved_bytes(plain, X), saved_bytes(quant, X)
    assert after > before + 0.9 * conv_weight_bytes, (before, after, conv_weight_bytes)


def test_negative_freeze_after_is_refused():
    tech = get_technique("quantization")
    with pytest.raises(ConfigError, match="freeze_after"):
        tech.check(tech.parse(["freeze_after=-1"]), None)


def test_freeze_after_stops_the_observers(make_config):
    build = build_pipeline(make_plan(make_config(192, ["quantization:x86:freeze_after=2"])))
    assert build.notes["fake_quantizers"] == 138
    (hook,) = build.runtime.step_hooks
    quantizers = fake_quantizers(build.model)
    for step in (1, 2):
        assert all(int(fq.observer_enabled) == 1 for fq in quantizers)
        hook(StepInfo(step=step, epoch=0, loss=0.5, batch_size=1, optimizer=None))
    assert all(int(fq.observer_enabled) == 0 for fq in quantizers)


def test_combines_with_bf16_autocast(make_config):
    try:
        get_technique("amp")
    except ConfigError:
        pytest.skip("amp technique not available yet")
    # 64 px keeps this fast: MS-SSIM needs > 160 px whatever its number of scales >= 2, so the
    # loss is one scale (plain SSIM, which needs one 11 px window), as the config check allows.
    cfg = make_config(64, ["quantization", "amp:bf16"], msssim_scales=1)
    build = build_pipeline(make_plan(cfg))
    rt, model = build.runtime, build.model
    opt = rt.optimizer_factory(model)
    x, y = X[..., :64, :64], Y[..., :64, :64]
    loss = rt.forward(model, x, y)
    rt.backward(loss)
    rt.step(opt)
    assert torch.isfinite(loss)
    apps = [m.activation_post_process.inner for m in model.modules()
            if isinstance(m, QATConv2d)]
    assert all(torch.isfinite(a.scale).all() and a.scale.dtype == torch.float32 for a in apps)
