"""memstudy tune: spec refusals before anything runs, log ranges, the fitness function, trials
recorded and never re-run on resume, the ranking of a recorded search, the single-worker island
fix applied to Propulate (on a stand-in class); the Propulate search itself, end to end in a
subprocess, when propulate and an MPI library are importable (not in CI: docs/tune.md)."""
from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from memstudy.errors import ConfigError
from memstudy.store import ResultsDB
from memstudy.tune import (LogRange, Trials, fitness, parse_spec, search_limits, trial_value)
from memstudy.tune.search import patch_single_worker_islands
from memstudy.tune.results import best_table, best_trials

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


@pytest.mark.parametrize("search, match", [
    ({"generations": "ten"}, r"generations must be an integer >= 1 \(got 'ten'\)"),
    ({"pop_size": 0}, "pop_size must be an integer >= 1"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"checkpoint": 3}, "checkpoint must be a string"),
])
def test_bad_search_settings_are_refused(search, match):
    with pytest.raises(ConfigError, match=match):
        parse_spec(_raw({"train.lr": [1e-4, 1e-2]}, **search))


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


    # the recorded search ranked: best first, the settings read back from the stored configs
    ranked = best_trials(spec, db)
    assert [r["fitness"] for r in ranked] == sorted([a, b])
    assert {r["params"]["train.optimizer"]: r["params"]["train.lr"] for r in ranked} == \
        {"adam": 1e-3, "sgd": 5e-3}
    other = parse_spec(_raw({"train.lr": [1e-4, 1e-2]}, {**BASE, "train": {**BASE["train"],
                                                                            "seed": 7}}))
    assert best_trials(other, db) == []  # another spec's search: none of these runs
    assert f"best: run {ranked[0]['run_id']}" in best_table(spec, db, 5)


def test_log_ranges_are_searched_as_log10_and_stay_inside():
    base = {**BASE, "techniques": ["lowrank"]}
    spec = parse_spec(_raw({"lowrank.beta": {"low": 1e-3, "high": 0.5, "log": True},
                            "train.lr": [1e-4, 1e-2]}, base))
    dim = spec.space["lowrank.beta"]
    assert isinstance(dim, LogRange) and dim == (1e-3, 0.5)
    limits = search_limits(spec)
    assert limits["lowrank.beta"] == pytest.approx((-3.0, math.log10(0.5)), abs=1e-12)
    assert limits["train.lr"] == (1e-4, 1e-2)  # plain ranges as given
    assert trial_value(dim, -2.0) == pytest.approx(1e-2, rel=1e-12)
    assert trial_value(dim, limits["lowrank.beta"][1] + 1e-9) == 0.5  # clipped, never above
    assert trial_value(dim, -3.0 - 1e-9) == 1e-3
    for bad, match in (({"low": 0.0, "high": 0.5, "log": True}, "0 < low < high"),
                       ({"low": 0.5, "high": 0.1, "log": True}, "0 < low < high"),
                       ({"low": 1e-3, "high": 0.5}, "log = true")):
        with pytest.raises(ConfigError, match=match):
            parse_spec(_raw({"lowrank.beta": bad}, base))


def test_efficiency_score_fitness_is_minus_the_score():
    ok = {"status": "ok", "efficiency_score": 38.0, "peak_bytes": 100.0}
    assert fitness(ok, "efficiency_score", None) == -38.0
    assert fitness(ok, "efficiency_score", 50) == 1.0 + 100.0 / 50  # behind every fitting trial
    assert fitness({**ok, "efficiency_score": None}, "efficiency_score", None) == math.inf
    with pytest.raises(ConfigError, match="metric 'score'"):
        parse_spec({**_raw({"train.lr": [1e-4, 1e-2]}), "fitness": {"metric": "score"}})


def test_a_trial_refused_before_it_runs_is_inf_and_records_nothing(tmp_path):
    base = {**BASE, "techniques": ["tri_accel:low=bf16:elastic=off"]}
    # both corners are valid (tau_low <= tau_high), the cross (1e-3, 1e-4) is not
    spec = parse_spec(_raw({"tri_accel.tau_low": [1e-6, 1e-3],
                            "tri_accel.tau_high": [1e-4, 1e-1]}, base))
    db = ResultsDB(tmp_path / "tune.sqlite")
    trials = Trials(spec, db)
    assert trials({"tri_accel.tau_low": 1e-3, "tri_accel.tau_high": 1e-4}) == math.inf
    assert trials.refused and not trials.ran and db.runs() == []


class _Comm:
    def __init__(self, size):
        self.size, self.rank, self.sent = size, 0, []


class _Propulator:
    """Stands in for propulate.Propulator 1.2.2: the dump hands the turn on with a send (to
    itself on a one-worker island: the call that blocks for ever under MPICH)."""

    def __init__(self, size, path):
        self.island_comm, self.island_idx = _Comm(size), 0
        self.checkpoint_path, self.population = path, ["ind0", "ind1"]

    def _dump_checkpoint(self):
        self.island_comm.sent.append(("dump-turn", 0 if self.island_comm.size == 1 else 1))

    def _determine_worker_dumping_next(self):
        return "probe"


def test_single_worker_islands_write_their_checkpoint_without_messaging_themselves(tmp_path):
    patch_single_worker_islands(_Propulator)
    patch_single_worker_islands(_Propulator)  # idempotent: not wrapped twice
    alone = _Propulator(1, tmp_path)
    alone._dump_checkpoint()
    alone.population = ["ind0", "ind1", "ind2"]
    alone._dump_checkpoint()
    assert alone.island_comm.sent == []  # no send to itself
    assert pickle.loads((tmp_path / "island_0_ckpt.pickle").read_bytes()) == alone.population
    assert pickle.loads((tmp_path / "island_0_ckpt.bkp").read_bytes()) == ["ind0", "ind1"]
    assert not (tmp_path / "island_0_ckpt.partial").exists()  # written, then renamed
    assert alone._determine_worker_dumping_next() is True  # keeps the turn
    shared = _Propulator(2, tmp_path / "two")
    shared._dump_checkpoint()
    assert shared.island_comm.sent == [("dump-turn", 1)]  # Propulate's own code
    assert shared._determine_worker_dumping_next() == "probe"


def _propulate_importable() -> str | None:
    """None when propulate and an MPI library import (in a child process, so this pytest
    process never initialises MPI); else why not."""
    probe = subprocess.run([sys.executable, "-c", "import propulate; from mpi4py import MPI"],
                           capture_output=True, text=True, timeout=120)
    return None if probe.returncode == 0 else probe.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_propulate_search_records_trials_and_resumes(tmp_path):
    why = _propulate_importable()
    if why:
        pytest.skip(f"propulate + MPI not importable (the tune extra is not in CI: numpy 2; "
                    f"docs/tune.md): {why}")
    spec_path, db = tmp_path / "spec.toml", tmp_path / "tune.sqlite"

    def search(generations: int) -> str:
        spec_path.write_text(_SPEC.format(generations=generations))
        done = subprocess.run([sys.executable, "-m", "memstudy", "--db", str(db), "tune",
                               str(spec_path)], capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).parents[1], env={**os.environ})
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    # propulate 1.2.2 alone: one trial, then a send to itself that never returns (timeout)
    assert "trained 3 trial(s)" in search(3)
    first = {r["id"]: r["config_hash"] for r in ResultsDB(db).runs()}
    assert len(first) == 3 and len(set(first.values())) == 3
    # started again with more generations: Propulate resumes from its checkpoint beside the
    # database (generation 3 of 5), the recorded trials stay
    assert "trained 2 trial(s)" in search(5)
    runs = {r["id"]: r["config_hash"] for r in ResultsDB(db).runs()}
    assert len(runs) == 5 and all(runs[i] == h for i, h in first.items())
    assert {r["label"] for r in ResultsDB(db).runs()} == {"tune"}


_SPEC = """
[base]
techniques = []
[base.train]
image_size = 64
msssim_scales = 1
epochs = 1
device = "cpu"
warmup_steps = 1
measure_steps = 1
[base.data]
train_images = 2
val_images = 1
[space]
"train.lr" = {{low = 1e-4, high = 1e-2, log = true}}
[search]
generations = {generations}
pop_size = 2
seed = 0
"""


def test_the_shipped_triaccel_search_is_valid_apart_from_its_gpu():
    """benchmarks/specs/tune-triaccel.toml parses and plans with only the GPU parts changed
    (device cpu, bf16 as the lowest tier): its keys, log ranges and corners are valid."""
    from memstudy.config import read_toml

    raw = read_toml(str(Path(__file__).parents[1] / "benchmarks/specs/tune-triaccel.toml"), "spec")
    raw["base"]["train"]["device"] = "cpu"
    raw["base"]["techniques"] = [t + ":low=bf16" for t in raw["base"]["techniques"]]
    spec = parse_spec(raw)
    assert spec.metric == "efficiency_score" and set(spec.space) == {
        "tri_accel.tau_low", "tri_accel.tau_high", "tri_accel.tau_curv"}
    assert all(isinstance(d, LogRange) for d in spec.space.values())
    assert spec.space["tri_accel.tau_low"][1] <= spec.space["tri_accel.tau_high"][0]


def test_cli_best_reads_a_recorded_search_and_refuses_a_missing_database(tmp_path, capsys):
    from memstudy.cli import main

    spec = tmp_path / "spec.toml"
    spec.write_text(_SPEC.format(generations=2))
    missing = tmp_path / "none.sqlite"
    assert main(["--db", str(missing), "tune", str(spec), "--best", "3"]) == 2
    assert "existing --db" in capsys.readouterr().err and not missing.exists()
    ResultsDB(tmp_path / "empty.sqlite")
    assert main(["--db", str(tmp_path / "empty.sqlite"), "tune", str(spec), "--best", "3"]) == 0
    assert "no recorded trial of this spec" in capsys.readouterr().out


def test_cli_best_reads_a_gpu_search_on_a_machine_without_one(capsys):
    """The H100 search's database (H100, 2026-11-23) is read here, on the CPU: reading plans
    nothing on the spec's cuda device. Its trials ran with the chunked loss at a fixed 256 rows;
    since config hash schema 2 (train.loss_chunk_rows = auto) they are another configuration, so
    they no longer count as trials of the spec."""
    import shutil
    import tempfile

    from memstudy.cli import main

    root = Path(__file__).parents[1]
    with tempfile.TemporaryDirectory() as tmp:  # reading opens the database for writing
        db = Path(tmp) / "tune.sqlite"
        shutil.copy(root / "benchmarks/results/h100/triaccel/tune.sqlite",
                    db)
        rc = main(["--db", str(db), "tune", str(root / "benchmarks/specs/tune-triaccel.toml"),
                   "--best", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no recorded trial of this spec" in out
