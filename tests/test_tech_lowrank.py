"""lowrank (OIALR, [Coquelin] (docs/references.md) Algorithm 1): conversion exactness, eq. 4.13, the schedule, the
optimizer-state surgery, refusals, and one recorded run of the U-Net."""
import math

import pytest
import torch
from torch import nn

from conftest import small_config
from memstudy.errors import ConfigError
from memstudy.lowrank.factors import LowRankWeight, base_update, kept_rank
from memstudy.lowrank.oialr import OIALRController, optimizer_state_bytes
from memstudy.runtime import StepInfo
from memstudy.techniques import get_technique
from memstudy.techniques.compose import make_plan

TECH = get_technique("lowrank")
F64_TOL = 1e-10  # float64 rounding of an SVD and two products of <= 64 x 144 matrices


def _net(dtype=torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(),
                         nn.Conv2d(16, 12, 3), nn.Flatten(), nn.Linear(12 * 4 * 4, 10),
                         nn.Linear(10, 3)).to(dtype)


def _info(step, optimizer):
    return StepInfo(step=step, epoch=0, loss=0.0, batch_size=1, optimizer=optimizer)


def test_conversion_reproduces_weight_and_output_exactly_in_float64():
    net = _net()
    x = torch.randn(2, 1, 10, 10, dtype=torch.float64)
    before = net(x)
    conv = net[2]
    w = conv.weight.detach().clone()
    lw = LowRankWeight("2", conv)
    assert "weight" not in dict(conv.named_parameters())
    assert lw.rank == min(16, 8 * 9)  # full rank at the conversion
    assert torch.allclose(lw.product(), w, atol=F64_TOL, rtol=0)
    assert torch.allclose(net(x), before, atol=F64_TOL, rtol=0)
    # only Sigma trains; U and V^T are buffers
    assert [n for n, _ in conv.named_parameters()] == ["bias", "lowrank_s"]
    assert {"lowrank_u", "lowrank_vt"} <= {n for n, _ in conv.named_buffers()}


def test_gradient_of_sigma_is_eq_4_12_projection_of_the_weight_gradient():
    net = _net()
    x = torch.randn(2, 1, 10, 10, dtype=torch.float64)
    conv = net[4]
    net(x).square().sum().backward()
    grad_w = conv.weight.grad.reshape(12, -1).clone()
    net.zero_grad()
    lw = LowRankWeight("4", conv)
    net(x).square().sum().backward()
    expected = conv.lowrank_u.T @ grad_w @ conv.lowrank_vt.T  # dS = U^T dL/dW V
    assert torch.allclose(lw.sigma.grad, expected, atol=1e-9, rtol=0)


def test_base_update_follows_eq_4_13_on_a_constructed_case():
    torch.manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(20, 5, dtype=torch.float64))
    vt = torch.linalg.qr(torch.randn(30, 5, dtype=torch.float64))[0].T
    # a trained, non-diagonal Sigma with known singular values 10, 5, 2, 0.5, 0.01
    p, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64))
    q, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64))
    svals = torch.tensor([10.0, 5.0, 2.0, 0.5, 0.01], dtype=torch.float64)
    sigma = p @ torch.diag(svals) @ q.T
    new_u, new_s, new_vt = base_update(u, sigma, vt, beta=0.1)  # keeps >= 1.0: three values
    assert new_s.shape == (3, 3)
    assert torch.allclose(torch.diag(new_s), svals[:3], atol=1e-12, rtol=0)
    assert torch.count_nonzero(new_s - torch.diag(torch.diag(new_s))) == 0  # Sigma' diagonal
    # U <- U U', V^T <- V'^T V^T with U', V' from SVD(Sigma): here U' = P, V' = Q (up to signs)
    signs = torch.sign(torch.diag(p.T @ (u.T @ new_u)))[:3]
    assert torch.allclose(new_u, (u @ p[:, :3]) * signs, atol=1e-12, rtol=0)
    assert torch.allclose(new_vt, (q[:, :3].T @ vt) * signs[:, None], atol=1e-12, rtol=0)
    # the kept part of W is reproduced exactly; only the dropped directions are lost
    kept = u @ p[:, :3] @ torch.diag(svals[:3]) @ q[:, :3].T @ vt
    assert torch.allclose(new_u @ new_s @ new_vt, kept, atol=1e-12, rtol=0)
    # bases stay orthonormal
    assert torch.allclose(new_u.T @ new_u, torch.eye(3, dtype=torch.float64), atol=1e-12)


def test_kept_rank_cut_is_relative_to_the_largest():
    assert kept_rank(torch.tensor([4.0, 2.0, 0.41, 0.39]), 0.1) == 3
    assert kept_rank(torch.tensor([4.0, 0.1]), 0.5) == 1


def test_schedule_converts_at_d_then_updates_last_layers_first_and_slices_adam_state():
    net = _net(torch.float32)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ctrl = OIALRController(net, d=2, nu=2, alpha=0.5, beta=0.8, skip_first=True, skip_last=True)
    names = [n for n, _ in ctrl.layers]
    assert names == ["2", "4", "6"]  # first conv and last linear kept full rank
    x = torch.randn(4, 1, 10, 10)

    def step(t, before_hook=lambda: None):
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        before_hook()
        ctrl.on_step(_info(t, opt))

    step(1)
    assert not ctrl.converted
    full_state = optimizer_state_bytes(opt)
    step(2)  # t == d: converted, full weights out of the optimizer (and their state freed)
    assert ctrl.converted and [lw.rank for lw in ctrl.factors] == [16, 12, 10]
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(lw.sigma) in params for lw in ctrl.factors)
    assert optimizer_state_bytes(opt) < full_state
    step(3)  # 3 % nu != 0: no update
    ranks = [lw.rank for lw in ctrl.factors]
    assert ranks == [16, 12, 10]
    state_before = {}
    step(4, lambda: state_before.update(
        {id(lw.sigma): opt.state[lw.sigma]["exp_avg"].clone() for lw in ctrl.factors}))  
    # update u=1: the last ceil(3 * 0.5 * 1) = 2 layers; beta = 0.8 cuts ranks of random weights
    first, *last = ctrl.factors
    assert first.rank == 16  # not yet in the update set
    for lw in last:
        k = lw.rank
        assert k < {"4": 12, "6": 10}[lw.name]
        assert lw.sigma.shape == (k, k)
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.state[lw.sigma][key].shape == (k, k)
        assert torch.equal(opt.state[lw.sigma]["exp_avg"], state_before[id(lw.sigma)][:k, :k])
    step(5)  # Adam steps on the resized Sigma and state
    step(6)  # update u=2: ceil(3 * 0.5 * 2) = 3 layers, the first one included
    assert ctrl.factors[0].rank < 16
    steps = sorted({r[1] for r in ctrl.rows})
    assert steps == [1, 2, 4, 6]
    trainable = {r[1]: r[3] for r in ctrl.rows if r[2] == "lowrank_trainable_params"}
    assert trainable[2] < trainable[1] and trainable[6] <= trainable[4] <= trainable[2]
    assert trainable[6] == sum(p.numel() for p in net.parameters())


def test_d_zero_converts_before_the_optimizer_exists():
    net = _net(torch.float32)
    ctrl = OIALRController(net, d=0, nu=5, alpha=0.1, beta=0.1)
    assert ctrl.converted and all(lw.replaced is None for lw in ctrl.factors)


@pytest.mark.parametrize("option, match", [
    ("beta=1.0", "lowrank:beta"), ("beta=0", "lowrank:beta"), ("nu=0", "lowrank:nu"),
    ("d=1000", "lowrank:d"), ("alpha=1.5", "lowrank:alpha"), ("d=-1", "lowrank:d")])
def test_bad_options_are_refused_by_name(option, match):
    cfg = small_config(techniques=[f"lowrank:{option}"])
    with pytest.raises(ConfigError, match=match):
        make_plan(cfg)


def test_d_at_the_last_step_is_refused_and_one_before_is_allowed():
    cfg = small_config(techniques=["lowrank:d=2"], epochs=2)  # 2 images, batch 1: 4 steps
    make_plan(cfg)
    cfg = small_config(techniques=["lowrank:d=4"], epochs=2)
    with pytest.raises(ConfigError, match="lowrank:d=4"):
        make_plan(cfg)


def test_uncomposable_technique_is_refused_by_name():
    cfg = small_config(techniques=["lowrank", "quantization"])
    with pytest.raises(ConfigError, match="quantization"):
        make_plan(cfg)


def test_recorded_run_of_the_unet_trains_sigma_and_records_control_steps():
    from memstudy.runner import execute

    # 2 images, batch 1, 3 epochs: 6 steps; converted after step 2, updates after 4 and 6
    cfg = small_config(techniques=["lowrank:d=2:nu=2:alpha=0.5:beta=0.8"], epochs=3,
                       warmup_steps=3)
    rec = execute(cfg, None)
    assert rec.status == "ok", rec.error
    rows = {(r[1], r[2]): r[3] for r in rec.series if r[2].startswith("lowrank")}
    assert sorted({s for s, _ in rows}) == [1, 2, 4, 6]
    assert rows[(1, "lowrank_rank_sum")] == 0  # full rank: nothing converted yet
    assert rows[(6, "lowrank_rank_sum")] < rows[(4, "lowrank_rank_sum")] < rows[(2, "lowrank_rank_sum")]
    assert rows[(4, "lowrank_trainable_params")] < rows[(1, "lowrank_trainable_params")] / 2
    assert rows[(4, "lowrank_optimizer_state_bytes")] < rows[(1, "lowrank_optimizer_state_bytes")] / 2
    assert math.isfinite(rec.epochs[-1]["val_loss"])
    assert "net.decoder.blocks.0.conv1.0" in {n.split(":", 1)[1] for _, n in rows
                                              if n.startswith("lowrank_rank:")}
