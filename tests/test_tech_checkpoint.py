"""Activation checkpointing: less saved memory, identical gradients and BatchNorm statistics."""
from __future__ import annotations


import pytest
import torch

from memstudy.errors import ConfigError
from memstudy.models import build_unet
from memstudy.runner import execute
from memstudy.techniques.checkpoint import (RESNET34_UNET_UNITS, chain_units, sqrt_regions)
from memstudy.techniques.compose import build_pipeline, make_plan
from conftest import small_config
from helpers import Step, measured_step

PLACEMENTS = ("block", "sqrt", "selective")


def one_step(techniques: list[str]) -> Step:
    """One measured training step (forward, backward, optimizer step) of the composed pipeline."""
    return measured_step(techniques, optimizer_step=True)


@pytest.fixture(scope="module")
def plain() -> Step:
    return one_step([])


@pytest.fixture(scope="module", params=PLACEMENTS)
def checkpointed(request) -> tuple[str, Step]:
    return request.param, one_step([f"checkpoint:{request.param}"])


def test_checkpoint_lowers_saved_activations(plain, checkpointed):
    placement, step = checkpointed
    # Measured at 192 px, batch 1 (MiB): plain 53.7, selective 33.4, block 16.5, sqrt 8.2.
    limit = {"selective": 0.75, "block": 0.4, "sqrt": 0.2}[placement]
    for figure in ("saved_bytes", "tensor_held_bytes"):
        assert step.forward[figure] < limit * plain.forward[figure], (placement, figure)
    if placement == "selective":  # the convolution outputs really are kept (else = block, 0.31x)
        assert step.forward["saved_bytes"] > 0.5 * plain.forward["saved_bytes"]


def test_checkpoint_gradients_and_bn_statistics_match_plain(plain, checkpointed):
    placement, step = checkpointed
    assert step.loss == pytest.approx(plain.loss, rel=1e-6)
    assert step.grads.keys() == plain.grads.keys()  # no module renamed by the wrapping
    for name, grad in plain.grads.items():
        torch.testing.assert_close(step.grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # Recomputation in backward runs BatchNorm again; running statistics must move once.
    for name, buf in plain.buffers.items():
        if name.endswith("num_batches_tracked"):
            assert step.buffers[name].item() == buf.item() == 1, name
        else:
            torch.testing.assert_close(step.buffers[name], buf, rtol=1e-6, atol=1e-7, msg=name)


def test_checkpoint_regions_recorded(checkpointed):
    placement, step = checkpointed
    regions = step.notes["checkpoint_regions"]
    if placement == "sqrt":
        assert step.notes["checkpoint_segments"] == 5  # round(sqrt(22))
        assert len(regions) < 16 + 5  # fewer regions than `block`
    else:
        assert len(regions) == 16 + 5  # every BasicBlock and decoder block


def test_sqrt_units_and_regions():
    units = chain_units(build_unet())
    assert len(units) == RESNET34_UNET_UNITS == 22
    regions = sqrt_regions(units, 5)
    # Encoder regions never span a stage: stage outputs are skip features, kept anyway.
    assert all(len({u.group for u in r}) == 1 for r in regions)
    names = [[u.name for u in r] for r in regions]
    assert names[0] == ["stem"]
    assert ["decoder.1", "decoder.2", "decoder.3", "decoder.4"] in names  # segment 4: units 18-21
    assert [u.name for r in regions for u in r] == [u.name for u in units]  # a partition, in order
    assert len(sqrt_regions(units, 1)) == 6  # one segment: one region per group
    assert len(sqrt_regions(units, 22)) == 22


@pytest.mark.parametrize("spec, fragment", [
    ("checkpoint:diagonal", "['block', 'sqrt', 'selective']"),
    ("checkpoint:block:segments=3", "placement=sqrt"),
    ("checkpoint:sqrt:segments=23", "1..22"),
    ("checkpoint:sqrt:segments=-1", "segments=-1"),
])
def test_checkpoint_option_errors(spec, fragment):
    with pytest.raises(ConfigError) as err:
        make_plan(small_config(techniques=[spec]))
    assert fragment in str(err.value)


@pytest.fixture(scope="module")
def invertible() -> Step:
    pytest.importorskip("momentumnet")
    return one_step(["invertible"])


@pytest.mark.parametrize("placement", ["block", "sqrt"])
def test_checkpoint_makes_each_momentum_run_one_region(invertible, placement):
    """Chkp+Mom: a run of momentum blocks is one region that keeps only its input, so the pair
    saves less than either alone; gradients and BatchNorm statistics are invertible's own (the
    recomputation stops early inside momentumnet's forward, after which the rebuild must still
    leave the running statistics alone)."""
    alone = one_step([f"checkpoint:{placement}"])
    both = one_step(["invertible", f"checkpoint:{placement}"])
    assert "checkpoint_not_wrapped" not in both.notes
    assert both.forward["saved_bytes"] < alone.forward["saved_bytes"]
    assert both.forward["saved_bytes"] < 0.5 * invertible.forward["saved_bytes"]
    for name, grad in invertible.grads.items():
        torch.testing.assert_close(both.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    for name, buf in invertible.buffers.items():
        torch.testing.assert_close(both.buffers[name], buf, rtol=0, atol=0, msg=name)


def test_selective_checkpoint_leaves_momentum_runs_alone():
    """Its per-op policy would keep convolution outputs computed inside momentumnet's no-grad
    forward: the momentum runs stay unwrapped and are listed."""
    pytest.importorskip("momentumnet")
    build = build_pipeline(make_plan(small_config(techniques=["invertible", "checkpoint:selective"])))
    assert build.notes["checkpoint_not_wrapped"] == [
        "encoder.layer1.0", "encoder.layer2.1", "encoder.layer3.1", "encoder.layer4.1"]
    assert len(build.notes["checkpoint_regions"]) == 3 + 5  # 3 downsampling blocks, 5 decoder


@pytest.mark.gpu
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_checkpoint_lowers_cuda_forward_memory(placement):
    def forward_figures(techniques):
        cfg = small_config(size=512, techniques=techniques, validate=False, device="cuda",
                           warmup_steps=1, measure_steps=1)
        record = execute(cfg, db=None)
        assert record.status == "ok", record.error
        return {k: v for _, phase, k, v in record.metrics if phase == "forward"}

    plain, ckpt = forward_figures([]), forward_figures([f"checkpoint:{placement}"])
    assert ckpt["alloc_held_bytes"] < 0.8 * plain["alloc_held_bytes"]
    assert ckpt["alloc_peak_bytes"] < plain["alloc_peak_bytes"]


@pytest.mark.gpu
def test_checkpoint_with_fp16_runs_on_cuda():
    cfg = small_config(size=256, techniques=["amp:fp16", "checkpoint:sqrt"], device="cuda",
                       validate=True)
    record = execute(cfg, db=None)
    assert record.status == "ok", record.error
