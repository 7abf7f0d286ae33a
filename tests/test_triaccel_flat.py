"""Tri-Accel's flat gradient buffer (memstudy/techniques/tri_accel/flat_grads.py) and the curvature
budget."""
from __future__ import annotations


import pytest
import torch
from torch import nn

from memstudy.errors import ConfigError
from memstudy.techniques.tri_accel.grad_stats import (flatten, make_layout, segment_stats,
                                                   segment_stats_reference)
from memstudy.techniques.tri_accel.controller import curvature_affordable
from memstudy.techniques.tri_accel.flat_grads import FlatGradients
from helpers import run_interpreted


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Conv2d(8, 1, 1))
    ref = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Conv2d(8, 1, 1))
    ref.load_state_dict(net.state_dict())
    return net.to(memory_format=torch.channels_last), ref  # views must follow channels_last strides


def check_flat_path(kernel: bool) -> None:
    """Two backwards into the views (an accumulated step) give PyTorch's own gradients, and the
    statistics of the buffer, read in place, equal the reference on the concatenated gradients."""
    net, ref = _nets()
    groups = [list(net[0].parameters()), list(net[2].parameters()) + list(net[4].parameters())]
    ref_groups = [list(ref[0].parameters()), list(ref[2].parameters()) + list(ref[4].parameters())]
    flat = FlatGradients(groups, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(3, 1, 12, 12, generator=gen)
        flat.attach()
        net(x).square().mean().backward()
        ref(x).square().mean().backward()
    assert flat.attached()  # autograd accumulated into the views in place
    for p, q in zip(net.parameters(), ref.parameters()):
        assert p.grad.stride() == p.stride()
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    sizes = [sum(q.numel() for q in g) for g in ref_groups]
    gathered = flatten([q.grad for g in ref_groups for q in g])  # the old path: a concatenation
    ref_mean, ref_var = segment_stats_reference(gathered, [0, sizes[0], sum(sizes)])
    layout = make_layout(flat.sizes, tile=256)  # small tiles: segments span several
    mean, var = (segment_stats(flat.buffer, layout) if kernel
                 else segment_stats_reference(flat.buffer, layout.offsets.tolist()))
    torch.testing.assert_close(var, ref_var, rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-4, atol=1e-9)


def test_flat_views_give_pytorchs_gradients_and_reference_statistics():
    check_flat_path(kernel=False)


def test_flat_buffer_kernel_equals_reference_interpreted():
    run_interpreted("test_triaccel_flat", "check_flat_path(kernel=True)")


def test_zero_grad_drops_the_views_and_the_next_step_starts_from_zero():
    net, ref = _nets()
    flat = FlatGradients([list(net.parameters())], torch.device("cpu"))
    x = torch.randn(2, 1, 12, 12)
    flat.attach()
    net(x).sum().backward()
    net.zero_grad(set_to_none=True)  # what the training step does after the optimizer step
    flat.attach()
    net(x).sum().backward()
    ref(x).sum().backward()  # once: the first step's gradients must not leak into the second
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_controller_statistics_are_the_same_with_flat_and_separate_gradients():
    """One U-Net step through the controller: the unit variances fed to the EMA agree."""
    from helpers import measured_step

    ema = {}
    for layout in ("flat", "separate"):
        step = measured_step([f"tri_accel:low=bf16:elastic=off:curvature=off:grad_layout={layout}"],
                             optimizer_step=True)
        controller = next(h.__self__ for h in step.build.runtime.step_hooks
                          if getattr(h, "__name__", "") == "on_step")
        assert (controller.flat is not None) == (layout == "flat")
        ema[layout] = controller.ema.value
    torch.testing.assert_close(ema["flat"], ema["separate"], rtol=1e-4, atol=1e-14)


def test_curvature_budget_rule():
    assert curvature_affordable(spent=0.0, last=None, elapsed=1.0, budget=0.1)  # the first runs
    # spent 1 s of 20 s; another 1 s estimate: 2 / 21 < 0.1 runs, at 9 s elapsed 2 / 10 does not
    assert curvature_affordable(spent=1.0, last=1.0, elapsed=20.0, budget=0.1)
    assert not curvature_affordable(spent=1.0, last=1.0, elapsed=9.0, budget=0.1)
    assert curvature_affordable(spent=5.0, last=5.0, elapsed=5.0, budget=1.0)  # 1: never skips


@pytest.mark.parametrize("budget", ["0", "1.5", "-0.1"])
def test_bad_curvature_budget_is_refused(make_config, budget):
    from memstudy.techniques.compose import make_plan

    with pytest.raises(ConfigError, match="tri_accel:curv_budget"):
        make_plan(make_config(techniques=[f"tri_accel:low=bf16:elastic=off:curv_budget={budget}"]))
