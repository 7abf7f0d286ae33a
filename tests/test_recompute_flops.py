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

SIZE = 192  # the smallest MS-SSIM allows; FLOPs do not depend on values, only on shapes
STEM = "ContrastUNet.net.encoder.conv1"
HEAD = "ContrastUNet.net.segmentation_head"


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
