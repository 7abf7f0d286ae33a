"""memstudy tune: spec refusals before anything runs, the fitness function, trials recorded and
never re-run on resume; the Propulate search itself when propulate is installed (the `tune`
extra: it is not in `test`, see docs/tune.md)."""
from __future__ import annotations

import math

import pytest

from memstudy.errors import ConfigError
from memstudy.store import ResultsDB
from memstudy.tune import Trials, fitness, parse_spec

BASE = {"techniques": [], "train": {"image_size": 192, "epochs": 1, "device": "cpu",
                                    "warmup_steps": 1, "measure_steps": 1},
        "data": {"train_images": 2, "val_images": 1}}


def _raw(space, base=BASE, **search):
    return {"base": base, "space": space, "search": {"generations": 2, "pop_size": 2, **search}}


@pytest.mark.parametrize("space, match", [
    ({}, r"\[space\] is empty"),
    ({"train.lrate": [1e-4, 1e-2]}, "no setting 'lrate'"),
    ({"lowrank.beta": [0.05, 0.5]}, "technique 'lowrank' is not in"),
    ({"train.lr": [1e-2, 1e-4]}, "low 0.01 must be below"),
    ({"lr": [1e-4, 1e-2]}, "section or technique"),
])
def test_bad_specs_are_refused_before_anything_runs(space, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        parse_spec(_raw(space))


def test_unknown_technique_option_and_bad_corner_values_are_refused():
    base = {**BASE, "techniques": ["lowrank"]}
    with pytest.raises(ConfigError, match="no option 'gamma'"):
        parse_spec(_raw({"lowrank.gamma": [0.1, 0.2]}, base))
    with pytest.raises(ConfigError, match="lowrank:beta"):  # 1.5 refused by lowrank's own check
        parse_spec(_raw({"lowrank.beta": [0.05, 1.5]}, base))
    spec = parse_spec(_raw({"lowrank.beta": [0.05, 0.5], "lowrank.nu": [1, 3]}, base))
    assert spec.space == {"lowrank.beta": (0.05, 0.5), "lowrank.nu": (1, 3)}


def test_fitness_is_the_metric_within_budget_else_penalised():
    ok = {"status": "ok", "val_loss": 0.25, "peak_bytes": 100.0}
    assert fitness(ok, "val_loss", None) == 0.25
    assert fitness(ok, "val_loss", 200) == 0.25
    assert fitness(ok, "val_loss", 50) == 1.0 + 100.0 / 50
    assert fitness({**ok, "status": "oom"}, "val_loss", None) == math.inf
    assert fitness({**ok, "val_loss": float("nan")}, "val_loss", None) == math.inf


def test_trials_are_recorded_and_a_resumed_search_does_not_rerun_them(tmp_path):
    spec = parse_spec(_raw({"train.lr": [1e-4, 1e-2], "train.optimizer": ["adam", "sgd"]}))
    db = ResultsDB(tmp_path / "tune.sqlite")
    first = Trials(spec, db)
    a = first({"train.lr": 1e-3, "train.optimizer": "adam"})
    b = first({"train.lr": 5e-3, "train.optimizer": "sgd"})
    assert len(first.ran) == 2 and not first.reused
    runs = db.runs()
    assert len(runs) == 2 and {r["label"] for r in runs} == {"tune"}
    assert 0 <= a <= 1 and 0 <= b <= 1
    resumed = Trials(spec, db)  # an interrupted search started again
    assert resumed({"train.optimizer": "sgd", "train.lr": 5e-3}) == b
    assert resumed({"train.lr": 1e-3, "train.optimizer": "adam"}) == a
    assert not resumed.ran and len(resumed.reused) == 2
    assert len(db.runs()) == 2  # nothing trained twice


def test_propulate_search_records_trials_and_resumes(tmp_path):
    pytest.importorskip("propulate")
    pytest.importorskip("mpi4py")
    from memstudy.tune import run_tune

    raw = _raw({"train.lr": [1e-4, 1e-2]}, generations=2, pop_size=2,
               checkpoint=str(tmp_path / "ckpt"))
    spec = parse_spec(raw)
    db = ResultsDB(tmp_path / "tune.sqlite")
    trials = run_tune(spec, db)
    recorded = len(db.runs())
    assert recorded >= 1 and recorded == len(set(trials.ran))
    again = run_tune(parse_spec({**raw, "search": {**raw["search"], "checkpoint": str(tmp_path / "c2")}}), db)
    assert again.reused  # the same seed proposes the same first individuals: found, not re-run
    assert len(db.runs()) == recorded + len(set(again.ran))
