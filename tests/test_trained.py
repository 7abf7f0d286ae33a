"""runs.trained (memstudy.did_train): a run whose training loss never moved is recorded, shown and
reported as one that did not train; a run that trains is not flagged; older databases still
open and are judged from their loss series.

The dead start is real, not staged: at 192 px on the CPU, seed 1's freshly initialised U-Net
gives an output that MS-SSIM (pytorch-msssim, relu on each scale's term) scores exactly 0, so
the loss is 1 and every gradient 0, as seed 1 did at 512 px on an H100 (docs/paper.md)."""
from __future__ import annotations

import sqlite3

import pytest
import torch

from conftest import small_config
from memstudy.cli import summarize
from memstudy.grid.cells import CellProcess
from memstudy.grid.slurm import gather
from memstudy.grid.spec import Cell
from memstudy.report import build_report, decisions, load_runs, losses, phase_memory
from memstudy.runner import execute, seed_everything
from memstudy.store import ResultsDB, RunRecord, merge_databases
from memstudy.did_train import judge, loss_ranges

DEAD_SEED, LIVE_SEED = 1, 0  # at 192 px, 2 phantoms (found by running seeds 0-11: 1, 5, 9, 11 are dead)


def dead_config(seed: int = DEAD_SEED):
    cfg = small_config(192, seed=seed, max_steps=2)  # two steps: the fewest the rule judges
    cfg.train.batch_size = 1
    return cfg


@pytest.fixture(scope="module")
def dead_run(tmp_path_factory):
    db = ResultsDB(tmp_path_factory.mktemp("dead") / "r.sqlite")
    return db, execute(dead_config(), db)


def test_the_dead_start_gives_no_parameter_a_gradient():
    """The premise of the flag: at seed 1 the loss is exactly 1 and every gradient exactly 0,
    so the weights cannot move (the runner's order: data, then the seed, then the model)."""
    from memstudy.datasets import build_datasets
    from memstudy.quality import min_image_size
    from memstudy.techniques.compose import build_pipeline, make_plan
    from memstudy.train import make_batch

    cfg = dead_config()
    train_set, _val = build_datasets(cfg.data, 192, 1, min_image_size(cfg.train.msssim_scales))
    seed_everything(cfg.train.seed)
    build = build_pipeline(make_plan(cfg))
    x, y = make_batch(train_set, [0], build.device)
    loss = build.runtime.forward(build.model, x, y)
    build.runtime.backward(loss)
    assert loss.item() == 1.0
    assert all(p.grad is not None and not p.grad.any() for p in build.model.parameters())


def test_a_run_that_did_not_train_is_recorded_and_shown(dead_run):
    db, rec = dead_run
    assert rec.status == "ok", rec.error  # a sound measurement of memory and time ...
    assert rec.trained is False            # ... of a model that never moved
    assert "| did not train (training loss 1 at every one of 2 steps)" in summarize(rec)
    assert [r["trained"] for r in db.runs()] == [0]
    # the grid's outcome table, from the recorded row: a local cell's and a Slurm cell's
    cell = CellProcess.__new__(CellProcess)  # the run is recorded already: nothing to start
    cell.db_path, cell.hash, cell.before, cell.started = str(db.path), rec.config_hash, 0, rec.started_at
    assert cell.finish() == "ok, did not train"
    assert gather(db.path, Cell(0, dead_config(), hash=rec.config_hash)) == "ok, did not train"


def test_reports_do_not_average_or_rank_a_run_that_did_not_train(dead_run, tmp_path):
    dead_db, _rec = dead_run
    db = ResultsDB(tmp_path / "both.sqlite")
    merge_databases(db.path, [dead_db.path])
    live = execute(dead_config(LIVE_SEED), db)  # the same set at a seed that trains
    assert live.status == "ok" and live.trained is True
    assert "did not train" not in summarize(live)
    row, = losses(db)
    assert (row["runs"], row["not_trained"]) == (1, 1)
    assert row["val_loss"] == live.epochs[-1]["val_loss"]  # the live seed's alone
    assert phase_memory(db)[0]["status"] == "ok, 1 did not train"
    decision, = decisions(db, [2**40])  # a budget every run fits
    assert decision["name"] == "original"
    assert "1 of 2 seeds did not train" in decision["note"]
    assert "did not train" in build_report(db)


def test_a_set_that_never_trained_is_not_ranked(dead_run):
    db, _rec = dead_run
    assert decisions(db, [2**40]) == []  # nothing that trained to decide between
    row, = losses(db)
    assert row["val_loss"] is None and row["not_trained"] == 1
    assert "original" in phase_memory(db)[0]["name"]  # its memory is still reported


def test_the_h100_paper_grid_names_seed_1(tmp_path, capsys):
    """The recorded H100 paper-protocol database predates the flag: seed 1 of original is
    judged from its loss series (1.0 at all 2400 steps) and left out of Table 1A's means."""
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    import bench_paper

    h100 = root / "benchmarks/results/h100/paper/paper-protocol-512px.sqlite"
    copy = tmp_path / "paper.sqlite"
    copy.write_bytes(h100.read_bytes())  # the committed file is never opened for writing
    original = {r["config"]["train"]["seed"]: r["trained"] for r in load_runs(copy)
                if r["name"] == "original"}
    assert original == {0: True, 1: False, 2: True, 3: True}
    assert bench_paper.main([str(copy), "--format", "md"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "| original |" in line)
    assert "(n=3)" in row and row.rstrip().endswith("| 1 | ok |")


def test_the_rule():
    assert judge([(2, 1.0, 1.0)]) is False
    assert judge([(2400, 1.0, 1.0), (2400, 0.0, 0.0)]) is False  # every rank pinned
    assert judge([(3, 1.0, 1.0), (3, 0.25, 0.5)]) is True  # another rank's loss moved
    assert judge([(2, 0.5, 0.5 + 2**-24)]) is True  # one bit apart: moved
    assert judge([(1, 1.0, 1.0)]) is None and judge([]) is None  # not judged
    series = [(0, 1, "loss", 0.7), (0, 1, "batch_size", 1), (0, 2, "loss", 0.6), (1, 1, "loss", 1.0)]
    assert loss_ranges(series) == {0: (2, 0.6, 0.7), 1: (1, 1.0, 1.0)}


def test_an_older_database_opens_and_is_judged_from_its_loss_series(tmp_path):
    def run(key: str, losses: list[float], trained: bool | None = None) -> RunRecord:
        return RunRecord(config={"train": {"image_size": 192, "batch_size": 1}}, config_hash=key,
                         name="original", status="ok", env={"device": "cpu"}, started_at=0.0,
                         series=[(0, s + 1, "loss", v) for s, v in enumerate(losses)],
                         trained=trained)

    old = tmp_path / "old.sqlite"
    db = ResultsDB(old)
    db.record(run("pinned", [1.0, 1.0, 1.0]))
    db.record(run("moving", [0.9, 0.8, 0.7]))
    con = sqlite3.connect(old)  # as an older memstudy left it: no column `trained`
    con.execute("ALTER TABLE runs DROP COLUMN trained")
    con.commit()
    con.close()
    before = old.read_bytes()
    # a report reads it as it is (nothing added) and judges by the same rule
    assert [r["trained"] for r in load_runs(old)] == [False, True]
    assert old.read_bytes() == before
    db = ResultsDB(old)  # a writer adds the column; its old runs stay unjudged (NULL) ...
    db.record(run("new", [0.5, 0.5], trained=True))  # the recorded flag wins over the series
    assert [r["trained"] for r in db.runs()] == [None, None, 1]
    assert [r["trained"] for r in load_runs(old)] == [False, True, True]  # ... and judged on read
    merged = tmp_path / "merged.sqlite"
    merge_databases(merged, [old])
    assert [r["trained"] for r in load_runs(merged)] == [False, True, True]
