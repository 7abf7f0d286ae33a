"""Activation checkpointing: less saved memory, identical gradients and BatchNorm statistics."""
from __future__ import annotations


import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memstudy.errors import ConfigError
from memstudy.models import build_unet
from memstudy.network import ModelConfig
from memstudy.runner import execute
from memstudy.techniques.checkpoint import (unet_units, apply_per_block, chain_units,
                                            checkpoint_module, sqrt_regions)
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


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run (forward, and backward including the recomputation)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


def block_checkpointed_unet(checkpointed: bool = True) -> nn.Module:
    model = build_unet().train()
    if checkpointed:
        apply_per_block(model, selective=False)
    return model


def step_ops(checkpointed: bool) -> tuple[collections.Counter, nn.Module]:
    model = block_checkpointed_unet(checkpointed)
    x = torch.rand(1, 1, 64, 64)
    with OpCounter() as counter:
        model(x).mean().backward()
    counter.counts.pop("detach", None)  # checkpoint's own bookkeeping aliases
    return counter.counts, model


def test_block_recomputation_runs_each_region_forward_once_and_nothing_else():
    """The checkpointed step = the plain step + one more forward of the regions' convolutions,
    BatchNorms and residual additions; no buffer snapshots (clone / copy_), no second running
    statistics update (an add_ of num_batches_tracked per BatchNorm), no other kind of op."""
    plain, _ = step_ops(False)
    ckpt, model = step_ops(True)
    regions = [b for stage in model.residual_stages for b in stage] + model.decoder_blocks
    inside = [m for r in regions for m in r.modules()]
    extra = ckpt - plain
    assert ckpt - extra == plain  # nothing of the plain step is missing
    assert extra["convolution"] == sum(isinstance(m, nn.Conv2d) for m in inside) == 45
    assert extra["native_batch_norm"] == sum(isinstance(m, nn.BatchNorm2d) for m in inside)
    assert extra["add_"] == len(model.residual_stages[0]) + sum(len(s) for s in model.residual_stages[1:])
    assert set(extra) <= set(plain) and not extra["clone"] and not extra["copy_"], extra


def test_rng_state_is_stashed_only_for_regions_that_draw_random_numbers(monkeypatch):
    """The U-Net's blocks draw no random numbers: checkpoint saves no RNG state for them. A
    region with dropout does, so its recomputation draws the forward's mask (gradients equal
    the plain module's)."""
    stashed = []
    real = torch.get_rng_state
    unet = block_checkpointed_unet()
    monkeypatch.setattr(torch, "get_rng_state", lambda: stashed.append(1) or real())
    unet(torch.rand(1, 1, 64, 64)).mean().backward()
    assert not stashed

    def net():
        torch.manual_seed(1)
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Dropout(0.5), nn.Conv2d(4, 1, 3))
    x = torch.rand(1, 1, 16, 16)
    grads = []
    for wrap in (False, True):
        model = net()
        if wrap:
            checkpoint_module(model)
        torch.manual_seed(2)
        model(x).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert stashed  # the dropout region's state was kept
    for plain_grad, ckpt_grad in zip(*grads):
        torch.testing.assert_close(ckpt_grad, plain_grad, rtol=0, atol=0)


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
    assert len(units) == unet_units(ModelConfig()) == 22
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
    ("checkpoint:diagonal", "['block', 'sqrt', 'selective', 'modules']"),
    ("checkpoint:block:segments=3", "placement=sqrt"),
    ("checkpoint:sqrt:segments=23", "1..22, the resnet34 U-Net's units"),
    ("checkpoint:sqrt:segments=-1", "segments=-1"),
    ("checkpoint:block:modules=down", "modules applies only to placement=modules"),
])
def test_checkpoint_option_errors(spec, fragment):
    with pytest.raises(ConfigError) as err:
        make_plan(small_config(techniques=[spec]))
    assert fragment in str(err.value)


def test_sqrt_segments_are_bounded_by_the_configured_encoders_units():
    """ResNet-18's U-Net has 1 + 8 + 5 = 14 units: 15 segments are refused, 14 accepted."""
    config = small_config(techniques=["checkpoint:sqrt:segments=15"])
    config.model.encoder = "resnet18"
    with pytest.raises(ConfigError, match="1..14, the resnet18 U-Net's units"):
        make_plan(config)
    config.techniques = ["checkpoint:sqrt:segments=14"]
    make_plan(config)


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


def test_recomputation_leaves_fake_quantizer_observers_alone():
    """quantization + checkpoint: the recomputation must not observe the activations a second
    time (a moving-average observer would move again from the second step on), so after two
    steps every buffer - BatchNorm statistics, observer ranges, scales - equals quantization's
    alone exactly."""
    def two_steps(techniques):
        torch.manual_seed(0)
        model = build_pipeline(make_plan(small_config(techniques=techniques))).model
        gen = torch.Generator().manual_seed(3)
        for _ in range(2):
            model(torch.rand(1, 1, 64, 64, generator=gen)).mean().backward()
        return dict(model.named_buffers())
    alone, both = two_steps(["quantization"]), two_steps(["quantization", "checkpoint"])
    assert alone.keys() == both.keys()
    for name, buf in alone.items():
        torch.testing.assert_close(both[name], buf, rtol=0, atol=0, msg=name)
