"""Training policy ([Compute-Opt] (docs/references.md) eq. 10-12), time to target and energy, through the real runner."""
from __future__ import annotations

import math

import pytest
import torch
from accumulate_helpers import run_tiny, series

from memstudy.lr_schedule import warmup_cosine
from memstudy.errors import ConfigError
from memstudy.meters.nvml import EnergyCounter
from memstudy.policy import GradientClipping, scaled_lr
from memstudy.techniques.compose import make_plan


def eq10(t: int, warmup: int, total: int, base: float, eta_min: float) -> float:
    if t <= warmup:
        return base * t / warmup
    return eta_min + (base - eta_min) * 0.5 * (1 + math.cos(math.pi * (t - warmup) / (total - warmup)))


@pytest.mark.parametrize("t", [1, 2, 3, 4, 7, 10, 20])
def test_warmup_cosine_is_eq10(t):
    assert warmup_cosine(t, 4, 20, 0.1) == pytest.approx(eq10(t, 4, 20, 1.0, 0.1), rel=1e-12)


def test_eq11_linear_scaling():
    assert scaled_lr(1e-3, effective_batch=8, base_batch=2, rule="linear") == pytest.approx(4e-3)
    assert scaled_lr(1e-3, effective_batch=8, base_batch=2, rule="none") == 1e-3


def test_schedule_and_scaling_on_the_loop(monkeypatch):
    """lr of each optimizer step = eq. 11 (B_eff = 2 x k=2 over B_base = 2) x eq. 10 (T = 6)."""
    rec, seen = run_tiny(monkeypatch, ["accumulate:2"], 2, steps=6, images=24, lr=1e-3,
                         lr_schedule="warmup_cosine", lr_warmup_steps=2, lr_min_ratio=0.1,
                         lr_scaling="linear")
    assert rec.status == "ok"
    expected = [eq10(t, 2, 6, 2e-3, 2e-4) for t in range(1, 7)]
    assert seen.lrs == pytest.approx(expected, rel=1e-9)  # what the optimizer ran with
    assert list(series(rec, "lr").values()) == pytest.approx(expected, rel=1e-9)  # recorded
    assert rec.config["train"]["lr_schedule"] == "warmup_cosine"  # in the stored config


def test_eq12_clipping():
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Build:  # what GradientClipping reads
        class config:
            class train:
                clip_norm = 1.0
        from memstudy.runtime import Runtime
        runtime = Runtime(torch.device("cpu"), 1, None, None)

    GradientClipping(Build).clip(opt)
    clipped = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(clipped, g * min(1.0, 1.0 / g.norm().item()), rtol=1e-6, atol=0)


def test_clipping_on_the_loop(monkeypatch):
    """With tau below the gradient norm the optimizer sees g * tau / ||g|| (eq. 12)."""
    _, plain = run_tiny(monkeypatch, [], 2, steps=1)
    rec, clipped = run_tiny(monkeypatch, [], 2, steps=1, clip_norm=1e-3)
    g = torch.cat([t.reshape(-1) for t in plain.grads[0]])
    assert series(rec, "grad_norm")[1] == pytest.approx(g.norm().item(), rel=1e-5)
    assert g.norm().item() > 1e-3  # so clipping acts
    got = torch.cat([t.reshape(-1) for t in clipped.grads[0]])
    torch.testing.assert_close(got, g * 1e-3 / g.norm(), rtol=1e-5, atol=1e-9)


def test_time_to_target_recorded_when_reached_absent_when_not(monkeypatch):
    reached, _ = run_tiny(monkeypatch, [], 2, steps=2, validate=True, target_val_loss=1.5)
    missed, _ = run_tiny(monkeypatch, [], 2, steps=2, validate=True, target_val_loss=1e-9)
    run = {name: v for _, phase, name, v in reached.metrics if phase == "run"}
    assert run["time_to_target_s"] > 0 and run["steps_to_target"] == 2
    assert not {"time_to_target_s", "steps_to_target"} & {m[2] for m in missed.metrics}


def test_energy_absent_on_the_cpu(monkeypatch):
    rec, _ = run_tiny(monkeypatch, [], 2, steps=1)
    assert "energy_j" not in {m[2] for m in rec.metrics}
    assert EnergyCounter.open(torch.device("cpu")) is None


@pytest.mark.gpu
def test_energy_recorded_on_a_gpu(make_config):
    from memstudy.runner import execute

    cfg = make_config(size=256)
    cfg.train.device = "cuda"
    rec = execute(cfg, None)
    run = {name: v for _, phase, name, v in rec.metrics if phase == "run"}
    assert rec.status == "ok" and run["energy_j"] > 0


@pytest.mark.parametrize("setting,value,message", [
    ("clip_norm", 0.0, "train.clip_norm must be > 0"),
    ("clip_norm", -1.0, "train.clip_norm must be > 0"),
    ("lr_schedule", "step", "train.lr_schedule 'step' unknown"),
    ("lr_scaling", "sqrt", "train.lr_scaling 'sqrt' unknown"),
    ("lr_warmup_steps", 3, "apply only to train.lr_schedule"),
    ("lr_base_batch", 4, "train.lr_base_batch applies only"),
    ("target_val_loss", 0.0, "train.target_val_loss must be > 0"),
])
def test_bad_settings_are_refused_by_name(make_config, setting, value, message):
    cfg = make_config()
    setattr(cfg.train, setting, value)
    with pytest.raises(ConfigError, match=message):
        make_plan(cfg)


def test_warmup_covering_every_step_is_refused(make_config):
    cfg = make_config(lr_schedule="warmup_cosine", lr_warmup_steps=2)  # 2 images, batch 1
    with pytest.raises(ConfigError, match="train.lr_warmup_steps = 2 covers all 2"):
        make_plan(cfg)


def test_schedule_with_tri_accel_is_refused(make_config):
    cfg = make_config(techniques=["tri_accel:low=bf16:elastic=off"], lr_scaling="linear")
    with pytest.raises(ConfigError, match="tri_accel sets every unit's learning rate"):
        make_plan(cfg)


# -- the report's cost objective (eq. 3) and accumulation table (eq. 9) ------------------------
MiB = 2 ** 20


def _store(db, name: str, techniques: list[str], batch: int, peak_mib: float,
           run: dict[str, float]) -> None:
    from memstudy.store import RunRecord

    config = {"train": {"image_size": 1024, "batch_size": batch}, "techniques": techniques}
    metrics = [(0, "forward", "alloc_start_bytes", 0.0),
               (0, "forward", "alloc_peak_bytes", peak_mib * MiB)]
    metrics += [(0, "run", k, v) for k, v in run.items()]
    db.record(RunRecord(config=config, config_hash=name, name=name, status="ok",
                        env={"device": "cuda:0", "gpu_name": "GPU"}, started_at=0.0,
                        metrics=metrics))


def test_cost_objective_normalises_each_figure_by_the_best(tmp_path):
    from memstudy.report import cost
    from memstudy.store import ResultsDB

    db = ResultsDB(tmp_path / "r.sqlite")
    _store(db, "a", [], 1, 100, {"time_to_target_s": 10.0, "energy_j": 5.0})
    _store(db, "b", [], 1, 50, {"time_to_target_s": 20.0, "energy_j": 10.0})
    _store(db, "c", [], 1, 200, {"energy_j": 20.0})  # never reached the target
    rows = {r["name"]: r for r in cost(db, (1.0, 1.0, 1.0))}
    # T/best: 1, 2, -; M/best: 2, 1, 4; E/best: 1, 2, 4
    assert rows["a"]["cost"] == pytest.approx(1 + 2 + 1)
    assert rows["b"]["cost"] == pytest.approx(2 + 1 + 2)
    assert rows["c"]["cost"] is None  # T is weighted but absent: no C, not a C without T
    without_time = {r["name"]: r["cost"] for r in cost(db, (0.0, 1.0, 1.0))}
    assert without_time == pytest.approx({"a": 3.0, "b": 3.0, "c": 8.0})


def test_accumulation_table_marks_the_best_throughput_per_memory(tmp_path):
    from memstudy.report import accumulation
    from memstudy.store import ResultsDB

    db = ResultsDB(tmp_path / "r.sqlite")
    _store(db, "big", [], 4, 400, {"throughput_px_s": 4e6})  # k = 1 at batch 4: 1e4 px/s per MB
    _store(db, "k2", ["accumulate:k=2:mode=fixed"], 2, 200, {"throughput_px_s": 3e6})  # 1.5e4
    _store(db, "k4", ["accumulate:k=4:mode=fixed"], 1, 150, {"throughput_px_s": 2e6})  # 1.33e4
    rows = accumulation(db)
    assert [(r["k"], r["effective_batch"]) for r in rows] == [(1, 4), (2, 4), (4, 4)]
    assert [r["optimal"] != "" for r in rows] == [False, True, False]


def test_bad_cost_weights_are_refused_by_name():
    from memstudy.report import parse_weights

    assert parse_weights("1,0.5,0") == (1.0, 0.5, 0.0)
    for text in ("1,1", "1,-1,0", "0,0,0", "a,b,c"):
        with pytest.raises(ConfigError, match="--cost-weights"):
            parse_weights(text)
