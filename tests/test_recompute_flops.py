"""Checkpoint's recomputation, pinned by counting FLOPs (torch.utils.flop_counter), as
torchtitan does for activation checkpointing: a forward + backward with checkpoint costs the
plain one plus exactly one more forward of what its regions hold, and nothing else.

The expected extra work is read from a plain forward's per-module counts, so the test states
which modules are recomputed, not a number copied from a run: `block` recomputes every residual
and decoder block (not the stem convolution, not the segmentation head), `sqrt` the stem as
well (its first region starts there), and `selective` no convolution at all (it saves them and
recomputes only the cheap ops, which count no FLOPs)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import small_config
from memstudy.techniques.compose import build_pipeline, make_plan
from memstudy.models.unet import up_conv_weight

SIZE = 192  # the smallest MS-SSIM allows; FLOPs do not depend on values, only on shapes
STEM = "UNet.net.encoder.conv1"
HEAD = "UNet.net.segmentation_head"


def _model(techniques: list[str]) -> torch.nn.Module:
    model = build_pipeline(make_plan(small_config(SIZE, techniques=techniques))).model
    return model.train()


def _step_flops(model: torch.nn.Module) -> int:
    x = torch.rand(1, 1, SIZE, SIZE)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def plain() -> tuple[int, dict[str, int]]:
    """(FLOPs of a plain forward + backward, forward FLOPs per module)."""
    model = _model([])
    with FlopCounterMode(display=False) as counter:
        model(torch.rand(1, 1, SIZE, SIZE))
    per_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    return _step_flops(model), per_module


@pytest.mark.parametrize("placement, kept", [
    ("block", (STEM, HEAD)),  # the stem stays saved, the head is outside every region
    ("sqrt", (HEAD,)),
])
def test_checkpoint_recomputes_one_forward_of_its_regions(plain, placement, kept):
    total, forward = plain
    recomputed = forward["Global"] - sum(forward[name] for name in kept)
    assert forward[STEM] > 0 and forward[HEAD] > 0  # the exclusions are real modules
    assert _step_flops(_model([f"checkpoint:{placement}"])) == total + recomputed


def test_selective_checkpoint_recomputes_no_convolution(plain):
    total, _ = plain
    assert _step_flops(_model(["checkpoint:selective"])) == total


# tile's recomputation, in forward-equivalents of each tiled convolution beyond the plain step
# (one strip, so no halo rows: the counts are whole multiples). A region with K BatchNorms of
# its own runs K + 1 sweeps each way, each sweep recomputing the convolutions on the way to
# its BatchNorm or output, and each backward sweep adds its convolutions' gradients; the stem's
# convolution (the image needs no gradient: weight gradient only) also runs for block 3's skip.
# keep=all: the stem (K=1) runs conv1 in 2 sweeps each way, block 3's region once more; blocks
# 3 and 4's second convolutions sit in regions with K=1 (2 sweeps each way); keep=bn: every
# region has K=0 (one sweep each way: one recomputation, gradients as plain); keep=half: as
# bn, but block 4's second convolution in the top region with K=1, as with keep=all.
TILED = {"conv1": "UNet.net.encoder.conv1",
         "block3.conv1": "UNet.net.decoder.blocks.3.conv1",
         "block3.conv2": "UNet.net.decoder.blocks.3.conv2",
         "block4.conv1": "UNet.net.decoder.blocks.4.conv1",
         "block4.conv2": "UNet.net.decoder.blocks.4.conv2",
         "head": HEAD}
EXTRA_FORWARDS = {
    "all": {"conv1": 7, "block3.conv1": 1, "block3.conv2": 5, "block4.conv1": 1,
            "block4.conv2": 5, "head": 1},
    "bn": {"conv1": 4, "block3.conv1": 1, "block3.conv2": 1, "block4.conv1": 1,
           "block4.conv2": 1, "head": 1},
    "half": {"conv1": 4, "block3.conv1": 1, "block3.conv2": 1, "block4.conv1": 1,
             "block4.conv2": 5, "head": 1},
}


# The first convolution of a tiled decoder block reads cat(up(d), skip): the tile bodies fold the
# up-sampling into a stride-2 transposed convolution of d (memstudy/tiling/tiled_forward.py, up_conv),
# whose multiply-adds over d's channels are 4 / 9 of the 3 x 3 convolution's at twice the
# resolution. Each evaluation, forward or gradient, of such a convolution costs `_fold_ratio`
# of the plain one's.
UP_FROM = {"block3.conv1": 2, "block4.conv1": 3}  # the decoder block whose output is up-sampled


def _fold_ratio(model: torch.nn.Module, name: str) -> float:
    blocks = model.net.decoder.blocks
    total = blocks[int(name[5])].conv1[0].in_channels
    up = blocks[UP_FROM[name]].conv2[0].out_channels
    return (4 * up + 9 * (total - up)) / (9 * total)


def _folding_flops(model: torch.nn.Module, name: str) -> tuple[int, int]:
    """FLOPs of folding the weights (an einsum) in one evaluation, forward and gradient."""
    blocks = model.net.decoder.blocks
    up = blocks[UP_FROM[name]].conv2[0].out_channels
    weight = blocks[int(name[5])].conv1[0].weight[:, :up].detach().requires_grad_()
    with FlopCounterMode(display=False) as forward:
        folded = up_conv_weight(weight, weight)
    with FlopCounterMode(display=False) as backward:
        folded.sum().backward()
    return forward.get_total_flops(), backward.get_total_flops()


@pytest.mark.parametrize("keep", sorted(EXTRA_FORWARDS))
def test_tile_recomputes_each_convolution_as_its_sweeps_say(plain, keep):
    total, forward = plain
    model = _model([f"tile:1:keep={keep}"])
    extra = 0.0
    for name, count in EXTRA_FORWARDS[keep].items():
        flops = forward[TILED[name]]
        if name in UP_FROM:  # plain: one forward and two gradients; tiled: each folded,
            # in 1 + count forwards and one gradient (the last op of its region), each of them
            # folding the weights too
            fold_forward, fold_gradient = _folding_flops(model, name)
            extra += ((3 + count) * _fold_ratio(model, name) * flops - 3 * flops
                      + (1 + count) * fold_forward + fold_gradient)
        else:
            extra += count * flops
    assert all(forward[module] > 0 for module in TILED.values())
    assert _step_flops(model) == pytest.approx(total + extra, rel=1e-12)


# levels=3 with layer1 cut into regions: evaluations of each encoder convolution inside the
# stem's regions (a forward sweep runs it once; a backward sweep recomputes it once and
# backpropagates: 2 more, or 1 for the stem convolution, whose input the image needs no
# gradient). whole: one region with 7 BatchNorms (8 sweeps each way); layer1 convolution c
# (1..6 in order) lies on the way to the BatchNorms from its own on, so it runs in 8 - c
# sweeps. blocks: per BasicBlock, K=2 (3 sweeps: conv1 in all, conv2 in 2); convs: the block's
# first convolution in a region of its own (1 sweep, its BatchNorm's statistics from it),
# conv2 in a region with K=1 (2 sweeps). Regions outside layer1 are the same in all three.
LAYER1_CONVS = [f"UNet.net.encoder.layer1.{j}.conv{k}" for j in range(3) for k in (1, 2)]


def _encoder_evaluations(layer1: str) -> dict[str, int]:
    if layer1 == "whole":
        sweeps = {name: 8 - c for c, name in enumerate(LAYER1_CONVS, start=1)}
        stem_sweeps = 8
    else:
        first = 1 if layer1 == "convs" else 3
        sweeps = {name: first if name.endswith("conv1") else 2 for name in LAYER1_CONVS}
        stem_sweeps = 2
    found = {name: 4 * n for name, n in sweeps.items()}
    found[TILED["conv1"]] = 3 * stem_sweeps
    return found


@pytest.fixture(scope="module")
def levels3_whole() -> int:
    return _step_flops(_model(["tile:1:levels=3"]))


@pytest.mark.parametrize("layer1", ["blocks", "convs"])
def test_layer1_regions_cut_the_recomputation_as_their_sweeps_say(plain, levels3_whole, layer1):
    _, forward = plain
    whole, cut = _encoder_evaluations("whole"), _encoder_evaluations(layer1)
    saved = sum((whole[name] - cut[name]) * forward[name] for name in whole)
    assert all(forward[name] > 0 for name in whole) and saved > 0
    assert _step_flops(_model([f"tile:1:levels=3:layer1={layer1}"])) == levels3_whole - saved
