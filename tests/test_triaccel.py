"""Tri-Accel parts on the CPU: power iteration, per-unit Hessian blocks, precision thresholds and
wrappers, and option checks. The elastic batch controller is in test_triaccel_elastic.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from memstudy.errors import ConfigError
from memstudy.techniques.compose import build_pipeline, make_plan
from memstudy.techniques.tri_accel.curvature import power_iteration, unit_eigenvalues
from memstudy.techniques.tri_accel.precision import LEVELS, VarianceEMA, assign_precision


def _quadratic(eigs: list[float], seed: int = 0):
    """f(w) = 0.5 w^T A w over two parameter tensors (3 + 3 entries), A with known spectrum."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))
    a = (q @ torch.diag(torch.tensor(eigs, dtype=torch.float64)) @ q.T).float()
    params = [nn.Parameter(torch.randn(3, generator=g)), nn.Parameter(torch.randn(3, generator=g))]

    def hvp(v):
        w = torch.cat(params)
        grad = torch.autograd.grad(0.5 * w @ a @ w, params, create_graph=True)
        return torch.autograd.grad(grad, params, grad_outputs=v)

    return params, hvp


def test_power_iteration_finds_top_eigenvalue():
    params, hvp = _quadratic([9.0, 4.0, 2.0, 1.0, 0.5, 0.1])
    (lam,) = power_iteration(hvp, params, k=1, iters=200, tol=1e-7,
                             generator=torch.Generator().manual_seed(1))
    assert lam == pytest.approx(9.0, rel=1e-3)


def test_power_iteration_deflation_finds_top_two():
    params, hvp = _quadratic([-1.0, 6.0, 3.0, 1.5, 0.5, 0.2])
    lams = power_iteration(hvp, params, k=2, iters=300, tol=1e-8,
                           generator=torch.Generator().manual_seed(2))
    assert lams == pytest.approx([6.0, 3.0], rel=1e-3)


def test_unit_eigenvalues_are_those_of_each_hessian_block_and_keep_bn_stats():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    loss_fn = nn.MSELoss()
    units = {"first": list(model[0].parameters()), "last": list(model[3].parameters())}
    running = model[1].running_mean.clone()
    got = unit_eigenvalues(model, loss_fn, x, y, units, k=1, iters=500,
                           generator=torch.Generator().manual_seed(0))
    assert torch.equal(model[1].running_mean, running)  # the estimate did not train BN
    for name, params in units.items():
        exact = _block_hessian_eigs(model, loss_fn, x, y, params)
        top = exact[exact.abs().argmax()].item()
        assert got[name][0] == pytest.approx(top, rel=1e-2, abs=1e-5)


def _block_hessian_eigs(model, loss_fn, x, y, params) -> torch.Tensor:
    names = {id(p): n for n, p in model.named_parameters()}
    keys, shapes = [names[id(p)] for p in params], [p.shape for p in params]
    flat0 = torch.cat([p.detach().reshape(-1) for p in params])
    saved = [b.clone() for b in model.buffers()]

    def f(flat):
        chunks, pos = {}, 0
        for k, s in zip(keys, shapes):
            chunks[k] = flat[pos:pos + s.numel()].reshape(s)
            pos += s.numel()
        return loss_fn(torch.func.functional_call(model, chunks, (x,)), y)

    h = torch.autograd.functional.hessian(f, flat0)
    with torch.no_grad():
        for b, s in zip(model.buffers(), saved):
            b.copy_(s)
    return torch.linalg.eigvalsh(h.double())


@pytest.mark.parametrize("var, low, expected", [
    (1e-8, "fp16", "fp16"), (1e-6, "fp16", "bf16"), (5e-4, "fp16", "bf16"), (1e-3, "fp16", "fp32"),
    (1.0, "fp16", "fp32"), (1e-8, "bf16", "bf16"), (2e-3, "bf16", "fp32")])
def test_precision_follows_thresholds(var, low, expected):
    assert assign_precision(var, tau_low=1e-6, tau_high=1e-3, low=low) == expected


def test_variance_ema():
    ema = VarianceEMA(beta=0.9)
    ema.update(torch.tensor([1.0, 2.0]))
    ema.update(torch.tensor([3.0, 0.0]))
    torch.testing.assert_close(ema.value, torch.tensor([0.9 + 0.3, 1.8]))


def _controller(make_config, technique: str):
    build = build_pipeline(make_plan(make_config(techniques=[technique])))
    (hook,) = build.runtime.step_hooks
    return build, hook.__self__


def test_control_step_sets_unit_precisions_and_forward_dtypes(make_config):
    build, ctrl = _controller(make_config, "tri_accel:low=bf16:curvature=off:elastic=off:"
                                           "tau_low=1e-6:tau_high=1e-3")
    names = [u.name for u in ctrl.units]
    variances = [1e-2 if n in ("stem", "decoder.4") else 1e-4 for n in names]
    ctrl.ema = VarianceEMA(0.9)
    ctrl.ema.update(torch.tensor(variances))
    ctrl.control(step=10)
    assert ctrl.precision.levels["stem"] == "fp32" and ctrl.precision.levels["encoder.layer2"] == "bf16"
    rows = {name: v for _, step, name, v in ctrl.series() if step == 10}
    assert rows["tri/precision/decoder.4"] == LEVELS.index("fp32")
    assert rows["tri/precision/head"] == LEVELS.index("bf16")
    seen = {}

    def remember(name):
        def hook(module, args, output):
            seen.setdefault(name, output.dtype)
        return hook

    for unit in ctrl.units:  # each unit's output dtype tells the precision it computed in
        unit.modules[0 if unit.name == "stem" else -1].register_forward_hook(remember(unit.name))
    out = build.model(torch.rand(1, 1, 64, 64))
    assert out.dtype == torch.float32  # the loss always sees float32
    assert seen["stem"] == torch.float32 and seen["decoder.4"] == torch.float32
    assert seen["encoder.layer2"] == torch.bfloat16 and seen["head"] == torch.bfloat16


def test_validation_runs_untiled_in_each_units_precision(make_config):
    """The tiled validation walk calls the blocks' layers itself, past tri_accel's per-unit
    autocast (a bf16 output then met a float32 layer: H100, 2026-11-23); with precision on,
    validation runs untiled, says why, and equals the model's own forward."""
    from memstudy.datasets import build_datasets
    from memstudy.train import _evaluate

    build, ctrl = _controller(make_config, "tri_accel:low=bf16:curvature=off:elastic=off")
    cfg = build.config
    cfg.train.val_tile_rows = 32  # tiled validation asked for
    ctrl.precision.levels.update({"stem": "bf16", "encoder.layer1": "fp32", "head": "bf16"})
    _, val_set = build_datasets(cfg.data, cfg.train.image_size, cfg.train.batch_size)
    result = _evaluate(build, val_set)
    assert build.notes["val_tiling"].startswith("untiled (tri_accel:precision")
    cfg.train.val_tile_rows = 0
    assert _evaluate(build, val_set) == result


def test_float32_validation_forces_every_unit_to_fp32(make_config):
    """train.val_precision = float32: tri_accel's units, which set autocast themselves, are
    forced to fp32 in the eval forward (the same figures as every unit at fp32), while the
    run's own precision (units at bf16) gives other figures."""
    from memstudy.datasets import build_datasets
    from memstudy.train import _evaluate

    build, ctrl = _controller(make_config, "tri_accel:low=bf16:curvature=off:elastic=off")
    cfg = build.config
    _, val_set = build_datasets(cfg.data, cfg.train.image_size, cfg.train.batch_size)
    ctrl.precision.levels.update({name: "bf16" for name in ctrl.precision.levels})
    as_run = _evaluate(build, val_set)
    float32 = _evaluate(build, val_set, float32=True)
    assert set(ctrl.precision.levels.values()) == {"bf16"}  # forced only within the forward
    ctrl.precision.levels.update({name: "fp32" for name in ctrl.precision.levels})
    assert float32 == _evaluate(build, val_set)
    assert float32["val_loss"] != as_run["val_loss"]


@pytest.mark.parametrize("technique, match", [
    ("tri_accel", "low=bf16"),  # fp16 on the CPU is refused, naming the option
    ("tri_accel:low=bf16", "budget"),  # elastic on the CPU needs a budget to steer by
    ("tri_accel:low=bf16:elastic=off:t_ctrl=10:t_curv=15", "multiple of t_ctrl"),
    ("tri_accel:precision=off:curvature=off:elastic=off", "does nothing"),
    ("tri_accel:low=bf16:elastic=off:stats=triton", "stats=auto"),
    ("tri_accel:low=bf16:elastic=off:curv_crop=96", "curv_crop"),
])
def test_bad_options_are_refused_by_name(make_config, technique, match):
    with pytest.raises(ConfigError, match=match):
        make_plan(make_config(techniques=[technique]))


def test_efficiency_score_definition_and_stored_run(tmp_path):
    from memstudy.store import ResultsDB, RunRecord
    from memstudy.techniques.tri_accel.score import control_rows, efficiency_score, run_efficiency

    # the paper's Table 1 (ResNet-18, FP32: 77.0 %, 21.0 s, 0.35 GB -> 10.48) comes out when
    # its "memory %" is 35, i.e. the VRAM in GB x 100; docs/triaccel.md notes this
    assert round(efficiency_score(77.0, 21.0, 35.0), 2) == 10.48
    db = ResultsDB(tmp_path / "r.sqlite")
    rec = RunRecord(config={"train": {"image_size": 192, "batch_size": 1}}, config_hash="h",
                    name="tri_accel", status="ok", env={"budget_bytes": 1000, "device": "cpu"},
                    started_at=0.0)
    rec.epochs = [{"epoch": 0, "steps": 2, "val_loss": 0.5, "time_s": 9.0},
                  {"epoch": 1, "steps": 4, "val_loss": 0.2, "time_s": 4.0}]
    rec.metrics = [(0, "forward", "tensor_start_bytes", 300), (0, "forward", "tensor_peak_bytes", 200)]
    rec.series = [(0, 2, "tri/precision/stem", 1.0), (0, 2, "batch_size", 3.0)]
    run_id = db.record(rec)
    eff = run_efficiency(db, run_id)
    assert eff["quality_pct"] == pytest.approx(80.0) and eff["time_per_epoch_s"] == 4.0
    assert eff["memory_pct"] == pytest.approx(50.0)
    assert eff["score"] == pytest.approx(80.0 / (4.0 * 50.0) * 100)
    rows = control_rows(db, run_id)
    assert rows[1] == {"step": 2, "name": "precision", "unit": "stem", "value": 1.0, "level": "bf16"}


@pytest.mark.gpu
@pytest.mark.alone  # the elastic batch reads NVML's used memory, which tests beside it change
def test_full_tri_accel_run_on_gpu(make_config, tmp_path):
    from memstudy.runner import execute
    from memstudy.store import ResultsDB
    from memstudy.techniques.tri_accel.score import control_rows

    cfg = make_config(size=256, techniques=["tri_accel:t_ctrl=1:t_curv=2:power_iters=2:top_k=2"])
    cfg.train.device = "cuda"
    cfg.data.train_images = 6
    db = ResultsDB(tmp_path / "r.sqlite")
    rec = execute(cfg, db)
    assert rec.status == "ok", rec.error
    names = {r["name"] for r in control_rows(db, db.runs()[-1]["id"])}
    assert {"precision", "grad_var", "eig2", "lambda_max", "lr", "mem_used_bytes",
            "batch_next", "batch_size"} <= names
