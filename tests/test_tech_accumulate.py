"""Gradient accumulation ([Compute-Opt] (docs/references.md) eq. 4-7) through memstudy's runner and training loop.

The equivalence tests use a BatchNorm-free tiny network (accumulate_helpers.TinyNet) through
the same runtime code path the U-Net takes: with BatchNorm, each micro-batch normalises with
its own statistics, so accumulation is *not* the larger batch (checked too)."""
from __future__ import annotations

import math

import pytest
import torch
from accumulate_helpers import run_tiny, series

from memstudy.errors import ConfigError
from memstudy.techniques.accumulate import adaptive_k, gradient_variance
from memstudy.techniques.compose import make_plan
from memstudy.techniques import planned_steps
from memstudy.train import check_measurable

TOL = dict(rtol=1e-5, atol=1e-7)  # float32 sums of the same terms in another order


@pytest.mark.parametrize("batch,k", [(2, 2), (1, 4)])
def test_k_micro_batches_give_the_gradient_of_the_k_times_larger_batch(monkeypatch, batch, k):
    big, big_seen = run_tiny(monkeypatch, [], 4, steps=2)
    acc, acc_seen = run_tiny(monkeypatch, [f"accumulate:{k}"], batch, steps=2)
    assert big.status == acc.status == "ok"
    assert len(acc_seen.grads) == 2  # two optimizer steps, each over k micro-batches
    for step in range(2):  # the second step also checks that step 1's update was the same
        for g_big, g_acc in zip(big_seen.grads[step], acc_seen.grads[step]):
            torch.testing.assert_close(g_acc, g_big, **TOL)
    assert series(acc, "micro_batches") == {1: k, 2: k}
    assert series(acc, "batch_size") == {1: batch, 2: batch}
    for step in (1, 2):  # the step's loss is the larger batch's loss
        assert series(acc, "loss")[step] == pytest.approx(series(big, "loss")[step], rel=1e-5)


def test_with_batchnorm_micro_batches_are_not_the_larger_batch(monkeypatch):
    """The documented BatchNorm caveat: per-micro-batch statistics change the gradient."""
    _, big = run_tiny(monkeypatch, [], 4, steps=1, batchnorm=True)
    _, acc = run_tiny(monkeypatch, ["accumulate:2"], 2, steps=1, batchnorm=True)
    diff = max((a - b).abs().max().item() for a, b in zip(acc.grads[0], big.grads[0]))
    assert diff > 1e-4


def test_short_last_step_weights_micro_batches_by_images(monkeypatch):
    """7 images, batch 2, k = 2: step 2 has micro-batches of 2 and 1 images (loss weights 2/3,
    1/3); its gradient equals the larger batch's last step of 3 images."""
    acc, seen = run_tiny(monkeypatch, ["accumulate:2"], 2, steps=2, images=7)
    big, big_seen = run_tiny(monkeypatch, [], 4, steps=2, images=7)
    assert series(acc, "micro_batches") == {1: 2, 2: 2}
    for g_acc, g_big in zip(seen.grads[1], big_seen.grads[1]):
        torch.testing.assert_close(g_acc, g_big, **TOL)


def test_eq6_adaptive_k():
    assert adaptive_k(sigma2=10.0, sigma_target=1.0, k_max=32) == 10
    assert adaptive_k(sigma2=10.5, sigma_target=1.0, k_max=32) == 11  # ceiling
    assert adaptive_k(sigma2=10.0, sigma_target=0.5, k_max=32) == 32  # 40, capped by k_max
    assert adaptive_k(sigma2=0.01, sigma_target=1.0, k_max=8) == 1


def test_eq7_variance_from_norms_equals_the_definition():
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(5, 1000, generator=gen, dtype=torch.float64) + 2.0  # 5 micro-batch gradients
    mean = g.mean(0)
    direct = ((g - mean) ** 2).sum() / (5 - 1)
    from_norms = gradient_variance([float(v @ v) for v in g], float(mean @ mean))
    assert from_norms == pytest.approx(float(direct), rel=1e-9)


def test_adaptive_accumulation_follows_eq6_eq7_on_the_loop(monkeypatch):
    """Each micro-batch's own gradient, taken independently from the running .grad sums
    (g_j = k (G_j - G_{j-1}), the loss being scaled by 1/k), gives sigma^2 by eq. 7 and the
    next k by eq. 6; the technique itself uses per-parameter hooks and a norm identity."""
    sigma_target = 0.01
    rec, seen = run_tiny(monkeypatch, [f"accumulate:mode=adaptive:k=3:k_max=6:sigma_target={sigma_target}"],
                         1, steps=2, images=12)
    assert rec.status == "ok"
    for step in (1, 2):
        sums = [g.double() for s, _, g in seen.sums if s == step]
        k = len(sums)
        assert k == (3 if step == 1 else series(rec, "accum_k_next")[1])
        g = torch.stack([k * (b - a) for a, b in zip([torch.zeros_like(sums[0]), *sums], sums)])
        expected = float(((g - g.mean(0)) ** 2).sum() / (k - 1))
        assert series(rec, "accum_sigma2")[step] == pytest.approx(expected, rel=1e-4)
        assert series(rec, "accum_k_next")[step] == max(2, min(6, math.ceil(expected / sigma_target ** 2)))
        assert series(rec, "micro_batches")[step] == k


@pytest.mark.parametrize("spec,option", [
    ("accumulate:k=0", "accumulate:k"),
    ("accumulate:mode=adaptive:k=2:k_max=0:sigma_target=1", "accumulate:k_max"),
    ("accumulate:mode=adaptive:k=2:sigma_target=0", "accumulate:sigma_target"),
    ("accumulate:mode=adaptive:k=2:sigma_target=-1", "accumulate:sigma_target"),
    ("accumulate:mode=adaptive:k=2", "accumulate:mode=adaptive needs accumulate:sigma_target"),
    ("accumulate:mode=adaptive:k=9:k_max=8:sigma_target=1", "2 <= k <= k_max"),
    ("accumulate:k=2:sigma_target=1", "apply only to mode=adaptive"),
])
def test_bad_options_are_refused_by_name(make_config, spec, option):
    with pytest.raises(ConfigError, match=option):
        make_plan(make_config(techniques=[spec]))


def test_steps_count_optimizer_steps(make_config):
    cfg = make_config(techniques=["accumulate:4"])
    assert planned_steps(cfg, 6) == 2  # ceil(6 / (1 x 4))
    adaptive = make_config(techniques=["accumulate:mode=adaptive:k=2:k_max=6:sigma_target=1"])
    assert planned_steps(adaptive, 12) == 6 and planned_steps(adaptive, 12, True) == 2
    adaptive.train.warmup_steps = 2  # at k_max = 6 the run takes only 2 steps: refused
    with pytest.raises(ConfigError, match="6 micro-batches per step"):
        check_measurable(adaptive, 12)
