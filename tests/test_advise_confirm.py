"""advise is honest about its reach: predictions beyond the distance it trusts are marked and
--confirm refuses them unless --force, naming the sizes that would bring them in; --confirm
shows progress, stops at a time limit, records a timed-out or interrupted run as such and
leaves nothing behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from memstudy import advise
from memstudy.cli import main
from memstudy.store import ResultsDB, RunRecord
from test_report_decide import db, gpu_run  # noqa: F401 (db: the fixture database)

MB = 1024**2


def refuse_runs(monkeypatch):
    import memstudy.grid.cells

    def started(*args, **kwargs):
        raise AssertionError("a confirm run was started")
    monkeypatch.setattr(memstudy.grid.cells, "CellProcess", started)


def test_confirm_refuses_a_far_extrapolation_naming_the_sizes_that_bring_it_in(  # noqa: F811
        db, capsys, monkeypatch):
    refuse_runs(monkeypatch)
    argv = ["--db", str(db.path), "advise", "--budget", "8GiB", "--size", "2048", "--confirm"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "beyond the 2x advise trusts" in captured.out  # marked in the table too
    (line,) = captured.err.strip().splitlines()
    # 2048**2 / 2 pixels: a square of 1449 px brings it within 2x; above 2048 px, inside
    assert "extrapolated 4.0x the pixels of 1024 px" in line and "1449 px or more" in line
    assert "above 2048 px (an interpolation)" in line and "--confirm --force" in line


def test_force_confirms_it_anyway_under_the_time_limit_given(db, monkeypatch, capsys):  # noqa: F811
    import memstudy.grid

    calls = []
    monkeypatch.setattr(memstudy.grid, "run_isolated",
                        lambda cfg, db_path, timeout_s, watch: calls.append(timeout_s) or "ok")
    base = ["--db", str(db.path), "advise", "--budget", "8GiB", "--size", "2048", "--confirm",
            "--force"]
    assert main(base) == 0 and main([*base, "--timeout", "5"]) == 0
    assert calls == [advise.CONFIRM_TIMEOUT_S, 5.0]
    assert main(["--db", str(db.path), "advise", "--budget", "8GiB", "--size", "768",
                 "--force"]) == 2
    assert "--force applies to --confirm" in capsys.readouterr().err


def cpu_db(tmp_path, make_config) -> ResultsDB:
    """Two recorded CPU runs of original (real configs, resolved as the runner stores them,
    so that a confirm run is of their experiment; tensor-meter figures) to fit."""
    from memstudy.runner import resolved

    db = ResultsDB(tmp_path / "cpu.sqlite")
    for size, peak_mb in ((192, 300), (256, 400)):
        cfg = make_config(size=size)
        cfg.train.validate = False
        cfg = resolved(cfg)
        metrics = [(0, phase, key, value) for phase in ("forward", "backward", "step")
                   for key, value in (("tensor_start_bytes", 200 * MB),
                                      ("tensor_peak_bytes", peak_mb * MB))]
        db.record(RunRecord(config=cfg.to_dict(), config_hash=f"fit{size}", name="original",
                            status="ok", env={"device": "cpu"}, started_at=0.0,
                            metrics=metrics + [(0, "run", "step_time_s", size / 100)]))
    return db


def prediction(db: ResultsDB, size: int) -> advise.Prediction:
    _device, preds, _skipped = advise.predict_all(db, "4GiB", size)
    return preds[0]


def test_a_confirm_past_its_time_limit_is_recorded_as_a_timeout(tmp_path, make_config,
                                                                 monkeypatch):
    from memstudy.grid import forkserver

    monkeypatch.setattr(forkserver, "ENABLED", False)  # a plain child: killed in its imports
    db = cpu_db(tmp_path, make_config)
    lines: list[str] = []
    assert advise.confirm(db.path, prediction(db, 224), 224, "4GiB", lines.append,
                          timeout_s=0.5) == "error in timeout"
    (run,) = [r for r in db.runs() if r["label"] == advise.CONFIRM_LABEL]
    assert run["failed_phase"] == "timeout" and "--confirm --timeout SECONDS" in run["error"]
    assert lines[0].startswith("confirming original at 224 px under 4GiB: at most 0 s")


def test_an_interrupted_confirm_is_recorded_as_such(tmp_path, make_config, monkeypatch):
    from memstudy.grid import forkserver

    monkeypatch.setattr(forkserver, "ENABLED", False)
    monkeypatch.setattr(advise, "CONFIRM_PROGRESS_S", 0)
    db = cpu_db(tmp_path, make_config)

    def ctrl_c(line: str) -> None:  # the first progress line after the start: Ctrl-C
        if not line.startswith("confirming"):
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        advise.confirm(db.path, prediction(db, 224), 224, "4GiB", ctrl_c)
    (run,) = [r for r in db.runs() if r["label"] == advise.CONFIRM_LABEL]
    assert run["status"] == "error" and run["failed_phase"] == "interrupted"


@pytest.mark.slow
def test_sigterm_stops_a_confirm_with_exit_130_one_line_and_nothing_left(tmp_path,
                                                                        make_config):
    """The user's case: SIGTERM to `advise --confirm` (its child and fork server running):
    exit 130 and one line, the run recorded as interrupted, no fork-server folder left."""
    db = cpu_db(tmp_path, make_config)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "memstudy", "--db", str(db.path), "advise",
                             "--budget", "4GiB", "--size", "224", "--confirm"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(scratch)})
    assert proc.stderr.readline().startswith("confirming original")
    time.sleep(1)  # the child is starting
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip().startswith("interrupted:"), err
    assert "Traceback" not in err
    (run,) = [r for r in db.runs() if r["label"] == advise.CONFIRM_LABEL]
    assert run["failed_phase"] == "interrupted"
    assert not list(scratch.glob("memstudy-forkserver-*"))
