"""The report's decision section on a small GPU-like database built with the store API."""
from __future__ import annotations

import csv
import io

import pytest

from memstudy import report
from memstudy.cli import main
from memstudy.store import ResultsDB, RunRecord

MB = 1024**2
GPU = "Test GPU 80GB"
CONTEXT_MB = 500  # what the budgeted runs measured; the others get it as an estimate
CATS = {"cat_params_bytes": 100, "cat_optimizer_bytes": 200}


def gpu_run(db: ResultsDB, name: str, size: int, fwd_mb: float, step_s: float,
            val: float | None = None, seed: int = 0, budget: str | None = None,
            status: str = "ok", others: int | None = None) -> None:
    """A CUDA run as the runner stores it: allocator figures per phase (start 300 MB, the
    forward's increment `fwd_mb`, backward and step smaller), categories, one epoch;
    `others`: the other processes it saw on its GPU (gpu_other_processes)."""
    metrics = []
    for phase, inc, grads in (("forward", fwd_mb, 0), ("backward", fwd_mb / 2, 100), ("step", 50, 0)):
        metrics += [(0, phase, "alloc_start_bytes", 300 * MB), (0, phase, "alloc_peak_bytes", inc * MB),
                    (0, phase, "cat_grads_bytes", grads * MB), (0, phase, "cat_other_bytes", 7 * MB),
                    (0, phase, "cat_saved_bytes", (fwd_mb / 2 if phase == "forward" else 0) * MB)]
        metrics += [(0, phase, k, v * MB) for k, v in CATS.items()]
    metrics.append((0, "run", "step_time_s", step_s))
    if others is not None:
        metrics.append((0, "run", "gpu_other_processes", others))
    env = {"device": "cuda:0", "gpu_name": GPU}
    if budget:
        env["cuda_context_bytes"] = CONTEXT_MB * MB
    epochs = [{"epoch": 4, "steps": 10, "train_loss": val, "val_loss": val, "time_s": 1.0}] if val else []
    db.record(RunRecord(
        config={"train": {"image_size": size, "batch_size": 1, "seed": seed, "epochs": 5},
                "data": {"seed": seed}, "techniques": [] if name == "original" else name.split("+"),
                "budget": budget, "world_size": 1, "label": "fixture"},
        config_hash=f"{name}-{size}-{seed}-{budget}", name=name, status=status, env=env,
        started_at=0.0, label="fixture", failed_phase=None if status == "ok" else "forward",
        metrics=metrics if status == "ok" else [], epochs=epochs if status == "ok" else []))


@pytest.fixture
def db(tmp_path):
    db = ResultsDB(tmp_path / "gpu.sqlite")
    for seed, (orig_s, val) in enumerate([(0.10, 0.30), (0.11, 0.31), (0.12, 0.32)]):
        gpu_run(db, "original", 512, 700, orig_s, val, seed)            # 1000 MB + context 500
        gpu_run(db, "amp", 512, 400, 0.06, val + 0.01, seed)            # 700 + 500
        gpu_run(db, "checkpoint", 512, 200, 0.15, val, seed)            # 500 + 500
    gpu_run(db, "amp", 1024, 1600, 0.20, budget="4GiB")                 # 1900 + 500 measured
    gpu_run(db, "checkpoint", 1024, 800, 0.50, budget="2GiB")           # 1100 + 500 measured
    gpu_run(db, "original", 1024, 0, 0, budget="2GiB", status="oom")
    return db


def decision(rows, budget: str, size: int) -> dict:
    (row,) = [r for r in rows if r["budget"] == budget and r["image_size"] == size]
    return row


def test_budgets_come_from_the_runs_and_the_option(db):
    assert report.budgets_found(db) == [2 * 1024**3, 4 * 1024**3]
    assert report.budgets_found(db, ["1GiB"])[0] == 1024**3


def test_the_fastest_set_that_fits_each_budget_wins(db):
    rows = report.decisions(db, report.budgets_found(db, ["1GiB"]))
    small = decision(rows, "2GiB", 512)
    assert small["name"] == "amp" and small["peak_mb"] == pytest.approx(1200)
    assert small["time_vs_original"] == pytest.approx(0.06 / 0.11)  # original's mean over seeds
    assert small["val_loss_delta"] == pytest.approx(0.01)
    assert small["val_loss_delta_std"] == pytest.approx((2 * 0.01**2) ** 0.5)  # both seed spreads
    assert "context estimated" in small["note"]  # unbudgeted runs: the GPU's measured context added
    assert decision(rows, "1GiB", 512)["name"] == "checkpoint"  # 1000 MB: only it fits 1 GiB
    assert decision(rows, "2GiB", 1024)["name"] == "checkpoint"  # amp peaks at 2400 MB
    large = decision(rows, "4GiB", 1024)
    assert large["name"] == "amp" and "original not measured ok" in large["note"]
    assert "quality at 512 px" in large["note"]
    none = decision(rows, "1GiB", 1024)
    assert none["name"] == "(none fits)" and "smallest peak 1600 MB: checkpoint" in none["note"]


def test_seed_spread_is_mean_std_and_n(db):
    (orig,) = [r for r in report.pareto(db) if r["name"] == "original"]
    assert orig["step_time_s"] == pytest.approx(0.11) and orig["runs"] == 3
    assert orig["step_time_s_std"] == pytest.approx(0.01)
    md = report.render("pareto", report.pareto(db), "md")
    assert "0.110 ± 0.010" in md
    rows = list(csv.reader(io.StringIO(report.render("pareto", report.pareto(db), "csv"))))
    header = rows[0]
    assert "step s std" in header  # raw formats give the spread its own column
    line = next(r for r in rows if r[header.index("techniques")] == "original")
    assert float(line[header.index("step s std")]) == pytest.approx(0.01)


def test_a_run_on_a_shared_gpu_keeps_its_memory_and_loses_its_time(db):
    """A fourth original seed that saw another process on its GPU (and took 5 s a step) is
    counted, its memory too, but its time is in no table, decision or prediction."""
    gpu_run(db, "original", 512, 700, 5.0, 0.30, seed=3, others=1)
    gpu_run(db, "amp", 512, 400, 0.06, 0.31, seed=3, others=0)  # looked, and had it alone
    (orig,) = [r for r in report.pareto(db) if r["name"] == "original"]
    assert orig["runs"] == 4 and orig["step_time_s"] == pytest.approx(0.11)
    assert orig["step_time_s_std"] == pytest.approx(0.01)
    (amp,) = [r for r in report.pareto(db) if r["name"] == "amp" and r["image_size"] == 512]
    assert amp["runs"] == 4 and amp["step_time_s_std"] == pytest.approx(0.0)  # its 4 times count
    small = decision(report.decisions(db, report.budgets_found(db)), "2GiB", 512)
    assert small["time_vs_original"] == pytest.approx(0.06 / 0.11)
    (table_row,) = [r for r in report.phase_memory(db, 512) if r["name"] == "original"]
    assert table_row["step_time_s"] == pytest.approx(0.11) and table_row["forward_mb"] == pytest.approx(700)
    gpu_run(db, "invertible", 512, 100, 0.01, 0.30, others=2)  # timed only beside another run
    small = decision(report.decisions(db, report.budgets_found(db)), "2GiB", 512)
    assert small["name"] == "amp" and "time from 4 of 4 runs" not in small["note"]
    assert "not ranked, timed only on a shared GPU: invertible" in small["note"]
    gpu_run(db, "amp", 512, 400, 0.06, 0.31, seed=4, others=1)
    small = decision(report.decisions(db, report.budgets_found(db)), "2GiB", 512)
    assert "time from 4 of 5 runs (the others shared their GPU)" in small["note"]


def test_pareto_marks_the_sets_no_other_beats_on_memory_and_time(db):
    marks = {r["name"]: r["pareto"] for r in report.pareto(db) if r["image_size"] == 512}
    assert marks == {"amp": "*", "checkpoint": "*", "original": ""}  # original: amp is both


def test_categories_split_each_phase_and_stand_beside_its_absolute_peak(db):
    rows = [r for r in report.phase_categories(db) if r["name"] == "original"]
    assert [r["phase"] for r in rows] == ["forward", "backward", "step"]
    fwd, bwd = rows[0], rows[1]
    assert fwd["cat_saved_bytes"] == pytest.approx(350) and bwd["cat_grads_bytes"] == 100
    assert fwd["held_mb"] == pytest.approx(100 + 200 + 350 + 7)
    assert fwd["peak_abs_mb"] == pytest.approx(1000)  # 300 start + 700, no context on the phase
    peaks = {r["name"]: r for r in report.phase_peaks(db) if r["image_size"] == 512}
    assert peaks["amp"]["forward_inc_mb"] == 400 and peaks["amp"]["forward_abs_mb"] == 700
    assert peaks["amp"]["backward_inc_mb"] == 200 and peaks["amp"]["runs"] == 3


@pytest.mark.parametrize("fmt", ["term", "md", "csv", "latex", "html"])
def test_decision_in_every_format(db, tmp_path, fmt):
    out = tmp_path / f"r.{fmt}"
    assert main(["report", str(db.path), "--format", fmt, "--budget", "1GiB", "--out", str(out)]) == 0
    text = out.read_text()
    assert "1GiB" in text and "(none fits)" in text and "checkpoint" in text
    assert ("saved activations" in text) and ("Forward abs" in text or fmt == "csv" and "Forward abs MB" in text)


def test_budgets_read_as_the_user_wrote_them(db):
    """--budget 400MiB is shown so, not as 0.390625GiB; budgets from the runs in round units."""
    text = report.build_report(db, "term", budget="400MiB")
    assert "400MiB" in text and "0.390625" not in text
    assert {r["budget"] for r in report.decisions(db, [3 * 2**29, "1.5 GiB"])} == {"1.5 GiB"}
    assert {r["budget"] for r in report.decisions(db, [400 * MB])} == {"400MiB"}


def _candidate(name: str, peak_mb: float, step_s: float | None) -> dict:
    """A set's row as decisions() hands it to _decision: one size, no validation."""
    return dict(name=name, device="cuda:0", peak_bytes=peak_mb * MB, step_time_s=step_s,
                step_time_s_std=None, differs="", comparison="", ok=2, not_trained=0, shared=0,
                step_n=2, context_estimated=False, batch_size=1, image_size=512, val_loss=None,
                run={"config": {"train": {"image_size": 512}}})


def test_a_decision_at_the_budgets_edge_names_what_it_left_out():
    """A peak equal to the budget fits; sets that did not train or were timed only beside
    another process are named when they would fit, not when they would not; the ratio is to
    original's fastest run; with nothing under the budget the smallest peak is named."""
    from memstudy.report.decide import _decision

    ok = [_candidate("original", 1000, 0.10), _candidate("amp", 600, 0.06),
          _candidate("checkpoint", 500, 0.15), _candidate("original", 1000, 0.12)]
    dead = [_candidate("invertible", 400, 0.05), _candidate("big", 700, 0.01)]
    untimed = [_candidate("compile", 600, None), _candidate("wide", 601, None)]
    row = _decision([], ok, 512, (600 * MB, "600MiB"), dead=dead, untimed=untimed)
    assert row == {"device": "cuda:0", "budget_bytes": 600 * MB, "budget": "600MiB",
                   "image_size": 512, "fits": "2/3", "name": "amp", "differs": "",
                   "peak_mb": 600.0, "step_time_s": 0.06, "step_time_s_std": None, "runs": 2,
                   "val_loss_delta": None, "val_loss_delta_std": None, "quality_epochs": None,
                   "quality_seeds": None, "time_vs_original": pytest.approx(0.6),
                   "note": "not ranked, did not train: invertible; not ranked, timed only on a "
                           "shared GPU: compile"}
    row = _decision([], ok, 512, (499 * MB, "499MiB"), dead=dead[:1])
    assert row == {"device": "cuda:0", "budget_bytes": 499 * MB, "budget": "499MiB",
                   "image_size": 512, "fits": "0/3", "name": "(none fits)",
                   "note": "smallest peak 500 MB: checkpoint; not ranked, did not train: "
                           "invertible"}


def test_phase_tables_hold_every_column_and_put_original_first(tmp_path):
    """phase_peaks and phase_categories row by row: original before the other sets of its
    size (whatever the alphabet), its two seeds' mean and sample spread, phases in training
    order, and every column a table or plot reads."""
    db = ResultsDB(tmp_path / "phases.sqlite")
    gpu_run(db, "original", 512, 700, 0.10, 0.30, seed=0)
    gpu_run(db, "original", 512, 720, 0.11, 0.31, seed=1)
    gpu_run(db, "amp", 512, 400, 0.06, 0.31)
    head = {"image_size": 512, "batch_size": 1, "device": GPU, "label": "fixture", "differs": ""}
    spread = pytest.approx(20 / 2**0.5)  # the sample std of 700 and 720
    original, amp = report.phase_peaks(db)
    assert original == {"name": "original", **head, "runs": 2,
                        "forward_inc_mb": 710.0, "forward_inc_mb_std": spread,
                        "forward_abs_mb": 1010.0, "forward_abs_mb_std": spread,
                        "backward_inc_mb": 355.0, "backward_inc_mb_std": pytest.approx(10 / 2**0.5),
                        "backward_abs_mb": 655.0, "backward_abs_mb_std": pytest.approx(10 / 2**0.5),
                        "step_inc_mb": 50.0, "step_inc_mb_std": 0.0,
                        "step_abs_mb": 350.0, "step_abs_mb_std": 0.0}
    assert amp["name"] == "amp" and amp["runs"] == 1 and amp["forward_inc_mb_std"] is None
    rows = report.phase_categories(db)
    assert [(r["name"], r["phase"], r["runs"]) for r in rows] == [
        ("original", "forward", 2), ("original", "backward", 2), ("original", "step", 2),
        ("amp", "forward", 1), ("amp", "backward", 1), ("amp", "step", 1)]
    assert rows[0] == {"name": "original", **head, "phase": "forward", "runs": 2,
                       "cat_params_bytes": 100.0, "cat_grads_bytes": 0.0,
                       "cat_optimizer_bytes": 200.0, "cat_saved_bytes": 355.0,
                       "cat_loss_saved_bytes": None, "cat_other_bytes": 7.0, "held_mb": 662.0,
                       "peak_abs_mb": 1010.0}


def test_a_decisions_note_says_each_caveat():
    """_note: every caveat a decision row can hold, in its order, and none without cause."""
    from memstudy.report.decide import _note

    best = dict(comparison="", not_trained=0, ok=3, context_estimated=False, shared=0, step_n=3)
    base = {"name": "original"}
    assert _note(best, base, 512, 512) == ""
    assert _note(best, base, None, 512) == ""
    assert _note(best, None, 512, 512) == "original not measured ok at this size"
    every = dict(best, comparison="batch 2", not_trained=1, context_estimated=True, shared=1,
                 step_n=2)
    assert _note(every, None, 256, 512, "train.batch_size=2") == (
        "original not measured ok at this size with the same settings; quality at 256 px; "
        "quality from runs with train.batch_size=2; 1 of 3 seeds did not train (quality from "
        "the others); context estimated; time from 2 of 3 runs (the others shared their GPU)")


def test_rows_are_ordered_by_device_size_original_first_then_name_label_differs_phase():
    from memstudy.report.decide import _row_order

    def row(name, size=512, device="A", **more):
        return {"name": name, "image_size": size, "device": device, **more}

    rows = [row("amp", phase="step"), row("amp", phase="forward"), row("zed"),
            row("original", label="b"), row("original", label="a"), row("amp", 1024),
            row("amp", device="B", differs="x"), row("amp", device="B"),
            row("amp", label="a", differs="y", phase="backward")]
    ordered = [(r["device"], r["image_size"], r["name"], r.get("label", ""),
                r.get("differs", ""), r.get("phase", "")) for r in sorted(rows, key=_row_order)]
    assert ordered == [
        ("A", 512, "original", "a", "", ""), ("A", 512, "original", "b", "", ""),
        ("A", 512, "amp", "", "", "forward"), ("A", 512, "amp", "", "", "step"),
        ("A", 512, "amp", "a", "y", "backward"), ("A", 512, "zed", "", "", ""),
        ("A", 1024, "amp", "", "", ""), ("B", 512, "amp", "", "", ""),
        ("B", 512, "amp", "", "x", "")]
