"""Mixed precision: bf16 halves saved activations, gradients stay close; refusals name the fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from memstudy.errors import ConfigError
from memstudy.runner import execute
from memstudy.techniques.amp import set_tf32
from memstudy.techniques.compose import build_pipeline, make_plan
from conftest import small_config
from helpers import measured_step

# bf16 against float32 gradients after one forward/backward of the freshly initialised model
# (192 px, batch 1; docs/techniques/amp.md explains the figures). Training-mode BatchNorm makes
# this backward ill-conditioned (float32 itself is 1.0% off float64), so bf16's 8-bit mantissa
# leaves the early layers' gradients far off: measured relative L2 error 0.96 over all
# parameters, cosine similarity 0.52, and 0.17 relative error at the output convolution.
HEAD = "net.segmentation_head.0.weight"
BF16_HEAD_REL_ERROR = 0.3
BF16_MIN_COSINE = 0.3


def one_forward_backward(techniques: list[str]) -> dict:
    step = measured_step(techniques, optimizer_step=False)
    model = step.build.model
    conv_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Conv2d))
    return {"loss": step.loss, "grads": step.grads, "buffers": step.buffers,
            "conv_weights": conv_weights, "forward": step.forward, "notes": step.notes,
            "runtime": step.build.runtime}


@pytest.fixture(scope="module")
def fp32():
    return one_forward_backward([])


@pytest.fixture(scope="module")
def bf16():
    return one_forward_backward(["amp:bf16"])


def test_bf16_halves_saved_activations(fp32, bf16):
    # Autocast also saves one bf16 copy of every convolution weight for backward (2 bytes per
    # weight, 48.8 MB here): at 192 px that outweighs the activation saving, so the measured
    # figure is higher than float32's. Activations alone are what halves.
    weight_copies = 2 * bf16["conv_weights"]
    for figure in ("saved_bytes", "tensor_held_bytes"):
        activations = bf16["forward"][figure] - weight_copies
        assert 0.4 * fp32["forward"][figure] < activations < 0.65 * fp32["forward"][figure], figure
    assert bf16["forward"]["saved_bytes"] > weight_copies  # the copies are counted, not hidden


def test_bf16_gradients_close_to_fp32(fp32, bf16):
    assert bf16["notes"]["autocast_dtype"] == "torch.bfloat16"
    assert bf16["runtime"].scaler is None  # bf16 has float32's range: no loss scaling
    head, ref = bf16["grads"][HEAD], fp32["grads"][HEAD]
    assert 0 < relative_error(head, ref) < BF16_HEAD_REL_ERROR  # > 0: bf16 really ran
    flat = [torch.cat([g.flatten() for g in run["grads"].values()]) for run in (bf16, fp32)]
    assert torch.nn.functional.cosine_similarity(*flat, dim=0) > BF16_MIN_COSINE
    assert bf16["loss"] == pytest.approx(fp32["loss"], abs=1e-2)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm())


def test_checkpoint_recomputes_under_the_forward_autocast(bf16):
    """checkpoint replays the forward's autocast state when it recomputes in backward: with
    amp:bf16 the gradients and BatchNorm statistics (updated in forward, restored after each
    recomputation in backward) equal amp:bf16 alone."""
    both = one_forward_backward(["amp:bf16", "checkpoint:sqrt"])
    assert both["forward"]["saved_bytes"] < 0.5 * bf16["forward"]["saved_bytes"]
    for name, grad in bf16["grads"].items():
        torch.testing.assert_close(both["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    for name, buf in bf16["buffers"].items():
        torch.testing.assert_close(both["buffers"][name], buf, msg=name)


def test_amp_resets_process_global_tf32():
    set_tf32(True)
    try:
        build_pipeline(make_plan(small_config(techniques=["amp:bf16"])))
        assert not torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        set_tf32(False)


@pytest.mark.parametrize("spec, fragments", [
    ("amp", ["train.device", "amp:bf16"]),  # fp16 is the default
    ("amp:fp16", ["train.device", "amp:bf16"]),
    ("amp:tf32", ["train.device", "8.0"]),
    ("amp:fp8", ["['fp16', 'bf16', 'tf32']"]),
    ("amp:bf16:init_scale=1024", ["init_scale", "fp16"]),
])
def test_amp_refusals_on_cpu(spec, fragments):
    with pytest.raises(ConfigError) as err:
        make_plan(small_config(techniques=[spec]))
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.gpu
@pytest.mark.slow
def test_fp16_with_grad_scaler_steps_on_cuda():
    cfg = small_config(size=256, techniques=["amp:fp16"], device="cuda")
    plan = make_plan(cfg)
    build = build_pipeline(plan)
    model, rt = build.model, build.runtime
    assert isinstance(rt.scaler, torch.amp.GradScaler) and rt.scaler.get_scale() == 2.0 ** 16
    optimizer = rt.optimizer_factory(model)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.rand(2, 1, 256, 256, device="cuda")
    # The first steps may overflow at scale 2**16 and be skipped (scale halved each time);
    # ten steps leave room for that and for real updates.
    for _ in range(10):
        loss = rt.forward(model, x, x.flip(-1))
        assert loss.dtype == torch.float32  # MS-SSIM outside autocast
        rt.backward(loss)
        rt.step(optimizer)
    assert torch.isfinite(loss)
    assert 0 < rt.scaler.get_scale() <= 2.0 ** 16
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    record = execute(small_config(size=256, techniques=["amp:fp16"], device="cuda"), db=None)
    assert record.status == "ok", record.error


@pytest.mark.gpu
def test_tf32_sets_flags_on_ampere_or_newer():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("TF32 needs compute capability >= 8.0")
    try:
        build_pipeline(make_plan(small_config(techniques=["amp:tf32"], device="cuda")))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        set_tf32(False)
