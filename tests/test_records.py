"""Records you can trust: each grid cell run once under concurrent runners, retries, merges
that add nothing twice, one-line errors for bad files and outputs, budgets refused before
training, every bad folder image listed, spellings merged in reports, pinned config hashes."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from memstudy import report
from memstudy.cli import main
from memstudy.config import RunConfig
from memstudy.errors import ConfigError
from memstudy.grid import expand, load_spec, plan_outcomes, to_toml
from memstudy.grid import claims
from memstudy.grid.claims import Holder, Runner
from memstudy.grid.spec import config_hash
from memstudy.runner import resolved
from memstudy.store import DatabaseError, ResultsDB, RunRecord, merge_databases

BASE = {"train": {"device": "cpu", "validate": False, "warmup_steps": 0, "measure_steps": 1},
        "data": {"train_images": 1, "val_images": 1}}


def write_spec(tmp_path: Path, sizes: list[int], **extra) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(to_toml({"name": "t", "image_sizes": sizes, "steps": 1, "base": BASE, **extra}))
    return path


def fake_run(db: ResultsDB, key: str, status: str = "ok", name: str = "original",
             techniques: list[str] | None = None, config: dict | None = None,
             failed_phase: str | None = None, started_at: float | None = None) -> None:
    """A run as the store holds it, without training (for claims, merges and reports)."""
    config = config or {"train": {"image_size": 192, "batch_size": 1}, "world_size": 1,
                        "techniques": techniques or []}
    db.record(RunRecord(config=config, config_hash=key, name=name, status=status,
                        env={"device": "cpu"}, started_at=time.time() if started_at is None
                        else started_at, failed_phase=failed_phase,
                        metrics=[(0, "forward", "tensor_peak_bytes", 1e6),
                                 (0, "forward", "tensor_start_bytes", 0.0)]))


def one_error_line(stderr: str, *names: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memstudy: error: "), stderr
    assert "Traceback" not in stderr
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------ claims: one run per cell
@pytest.mark.slow
def test_two_concurrent_runners_run_each_cell_once(tmp_path):
    """Both start together; the cell runs once and the other runner says who has it (or, if
    it came late, that the cell is recorded)."""
    db = tmp_path / "r.sqlite"
    spec = write_spec(tmp_path, [192])
    cmd = [sys.executable, "-m", "memstudy", "--db", str(db), "grid", str(spec)]
    runners = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for _ in range(2)]
    outputs = [r.communicate(timeout=300)[0] for r in runners]
    assert [r.returncode for r in runners] == [0, 0], outputs
    assert len(ResultsDB(db).runs()) == 1, outputs
    assert any("not run here: claimed by the runner" in out or "recorded" in out
               for out in outputs), outputs
    (log,) = (tmp_path / "r.cells").glob("*.log")  # one attempt, not overwritten
    assert log.read_text().count("=== ") == 1
    assert ResultsDB(db).query("SELECT * FROM claims") == []  # every claim released


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_claims_of_dead_or_silent_runners_are_taken_over(tmp_path):
    db = ResultsDB(tmp_path / "r.sqlite")
    me = Runner.this_process()
    # the runner that claimed cell a was killed: its pid is gone on this host
    assert claims.claim(db, "a", Runner(me.host, _dead_pid(), me.started)) is None
    assert claims.claim(db, "a", me) is None
    # a live runner keeps its cell, and the loser is told who has it
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = Runner(me.host, sleeper.pid, me.started)
        assert claims.claim(db, "b", live) is None
        holder = claims.claim(db, "b", me)
        assert isinstance(holder, Holder) and f"{me.host} pid {sleeper.pid}" in str(holder)
        claims.release(db, ["b"], me)  # not mine: stays theirs
        assert isinstance(claims.claim(db, "b", me), Holder)
    finally:
        sleeper.kill()
        sleeper.wait()
    # a runner on another host: taken over only once its heartbeat is older than STALE_S
    far = Runner("another-host", 1, me.started)
    assert claims.claim(db, "c", far, now=1000.0) is None
    assert claims.claim(db, "c", me, now=1000.0 + claims.STALE_S) == Holder("another-host", 1, 1000.0)
    assert claims.claim(db, "c", me, now=time.time() + claims.STALE_S + 1) is None
    # a cell recorded meanwhile is not claimed again
    fake_run(db, "d")
    assert claims.claim(db, "d", me)["status"] == "ok"


class _Reporting:
    """A connection that tells the test, before and after each statement, what it runs."""

    def __init__(self, con: sqlite3.Connection, before, after):
        self.con, self.before, self.after = con, before, after

    def execute(self, sql: str, *args):
        self.before(sql)
        cursor = self.con.execute(sql, *args)
        self.after(sql)
        return cursor

    def __enter__(self):
        self.con.__enter__()
        return self

    def __exit__(self, *exc):
        return self.con.__exit__(*exc)

    def close(self) -> None:
        self.con.close()


def test_two_claimers_interleaved_on_one_cell_one_claims_it(tmp_path):
    """Claimer A has read the cell free and is about to write its claim when claimer B starts.
    B must not read it free as well: its claim begins with BEGIN IMMEDIATE, which waits for A's
    write lock, and then it finds A's claim. In a deferred transaction both would read the
    cell free and both would claim it (or one would fail on its stale snapshot)."""
    import threading

    db = ResultsDB(tmp_path / "r.sqlite")
    connect = db._connect
    a_read, b_began = threading.Event(), threading.Event()

    def until(event: threading.Event, thread: threading.Thread) -> None:
        """Wait for `event`, or until `thread` has run and ended without setting it."""
        deadline = time.time() + 30
        while not event.wait(0.01) and not (thread.ident and not thread.is_alive()):
            assert time.time() < deadline

    def a_before(sql: str) -> None:
        if sql.upper().startswith("INSERT OR REPLACE INTO CLAIMS"):
            a_read.set()
            until(b_began, threads["B"])  # B at its BEGIN IMMEDIATE, or done reading

    def b_before(sql: str) -> None:
        if sql.upper() == "BEGIN IMMEDIATE":
            b_began.set()

    def b_after(sql: str) -> None:
        if "FROM CLAIMS" in sql.upper():
            b_began.set()

    hooks = {"A": (a_before, lambda sql: None), "B": (b_before, b_after)}
    db._connect = lambda: _Reporting(connect(), *hooks[threading.current_thread().name])
    now = time.time()
    runners = {"A": Runner("host-a", 1, now), "B": Runner("host-b", 2, now)}
    got: dict = {}

    def claim(name: str) -> None:
        try:
            got[name] = claims.claim(db, "cell", runners[name])
        except Exception as exc:  # reported below, beside the other claimer's result
            got[name] = exc

    threads = {name: threading.Thread(target=claim, args=(name,), name=name) for name in "AB"}
    threads["A"].start()
    until(a_read, threads["A"])  # A has read the cell free and holds its transaction open
    threads["B"].start()
    for thread in threads.values():
        thread.join(60)
    assert got["A"] is None, got
    assert isinstance(got["B"], Holder) and (got["B"].host, got["B"].pid) == ("host-a", 1), got
    rows = ResultsDB(tmp_path / "r.sqlite").query("SELECT config_hash, host, pid FROM claims")
    assert [tuple(r.values()) for r in rows] == [("cell", "host-a", 1)]


def test_a_claim_goes_stale_only_past_stale_s_and_its_heartbeat_keeps_it(tmp_path):
    """A claim of another host's runner is taken over once its heartbeat is more than STALE_S
    old; heartbeat() refreshes the runner's own claims only."""
    db = ResultsDB(tmp_path / "r.sqlite")
    me, far = Runner.this_process(), Runner("another-host", 1, 0.0)
    assert claims.claim(db, "c", far, now=1000.0) is None
    # exactly STALE_S old: still theirs, and the loser learns who has it since when
    assert claims.claim(db, "c", me, now=1000.0 + claims.STALE_S) == Holder("another-host", 1, 1000.0)
    claims.heartbeat(db, ["c"], me)  # not my claim: nothing changes
    assert db.query("SELECT claimed_at, heartbeat FROM claims") == [
        {"claimed_at": 1000.0, "heartbeat": 1000.0}]
    before = time.time()
    claims.heartbeat(db, ["c"], far)
    (row,) = db.query("SELECT claimed_at, heartbeat FROM claims")
    assert row["claimed_at"] == 1000.0 and before <= row["heartbeat"] <= time.time()
    assert isinstance(claims.claim(db, "c", me, now=1000.0 + claims.STALE_S + 1), Holder)
    assert claims.claim(db, "c", me, now=row["heartbeat"] + claims.STALE_S + 1) is None


def test_a_holder_and_a_runner_are_named_in_one_line():
    at = time.mktime((2026, 11, 28, 13, 5, 9, 0, 0, -1))
    assert str(Holder("node7", 4242, at)) == "claimed by the runner node7 pid 4242 since 13:05:09"
    assert str(Runner("node7", 4242, at)) == "node7 pid 4242"


def test_attempt_kinds_and_what_retry_runs_again():
    assert [claims.attempt_kind(*a) for a in [("error", "timeout"), ("error", "forward"),
                                              ("oom", "timeout"), ("ok", None)]] == [
        "timeout", "error", "oom", "ok"]
    runner = Runner("h", 1, 100.0)
    timed_out = {"status": "error", "failed_phase": "timeout", "finished_at": 99.0}
    assert claims.wants_rerun(timed_out, frozenset({"timeout"}), runner)
    assert not claims.wants_rerun(timed_out, frozenset({"error"}), runner)  # a kind of its own
    # ended as this runner started, not before it: another runner's retry, not repeated
    assert not claims.wants_rerun({**timed_out, "finished_at": 100.0}, frozenset({"timeout"}),
                                  runner)
    assert claims.wants_rerun(None, frozenset(), runner)  # never run
    assert claims.parse_retry(" error, timeout ,") == frozenset({"error", "timeout"})
    assert claims.parse_retry(None) == frozenset()
    with pytest.raises(ConfigError) as info:
        claims.parse_retry("crash,error,later")
    assert str(info.value) == ("--retry crash,later: not an attempt kind; give a comma-separated "
                               "list of error, oom, diverged, timeout")


def test_a_runner_is_alive_unless_its_process_is_gone_or_a_zombie(tmp_path, monkeypatch):
    import shutil

    child = subprocess.Popen([sys.executable, "-c", "pass"])  # exits, not reaped: a zombie
    stat, deadline = Path(f"/proc/{child.pid}/stat"), time.time() + 60
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.time() < deadline, stat.read_text()
        time.sleep(0.01)
    assert not claims._alive(child.pid)
    child.wait()
    assert not claims._alive(child.pid)  # reaped: gone
    # a live process whose name holds ") Z ": its state follows the name's last parenthesis
    named = tmp_path / "x) Z y"
    named.symlink_to(shutil.which("sleep"))
    sleeper = subprocess.Popen([str(named), "60"])
    try:
        assert claims._alive(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()

    def not_permitted(pid, signal):
        raise PermissionError(pid)

    monkeypatch.setattr(claims.os, "kill", not_permitted)
    assert claims._alive(12345)  # another user's process
    monkeypatch.setattr(claims.os, "kill", lambda pid, signal: None)

    def unreadable(path):
        raise OSError(path)

    monkeypatch.setattr(claims, "open", unreadable, raising=False)
    assert claims._alive(12345)  # its state unreadable: taken as alive, never run twice


def test_a_recorded_cell_is_retried_only_by_retry_and_only_once(tmp_path):
    db = ResultsDB(tmp_path / "r.sqlite")
    fake_run(db, "e", status="error", failed_phase="setup")
    earlier = Runner.this_process()
    assert claims.claim(db, "e", earlier)["status"] == "error"  # a plain rerun skips it
    assert claims.claim(db, "e", earlier, frozenset({"oom"}))["status"] == "error"
    assert claims.claim(db, "e", earlier, frozenset({"error"})) is None
    claims.release(db, ["e"], earlier)
    fake_run(db, "e", status="error", failed_phase="forward")  # the retry failed again
    # a runner started before that retry ended does not repeat it
    assert claims.claim(db, "e", earlier, frozenset({"error"}))["status"] == "error"
    with pytest.raises(ConfigError, match="--retry crash"):
        claims.parse_retry("error,crash")


def test_retry_reruns_an_error_cell_and_keeps_the_earlier_attempt(tmp_path, capsys):
    db = tmp_path / "r.sqlite"
    spec = write_spec(tmp_path, [192])
    (cell,) = expand(load_spec(spec))
    stored = resolved(cell.config).to_dict()
    fake_run(ResultsDB(db), cell.hash, status="error", failed_phase="forward", config=stored)
    assert main(["--db", str(db), "grid", str(spec), "-q"]) == 0
    assert "recorded earlier (skipped)" in capsys.readouterr().out
    assert "to run again (last: error)" in _dry_run(db, spec, "error", capsys)
    assert main(["--db", str(db), "grid", str(spec), "-q", "--retry", "error"]) == 0
    runs = ResultsDB(db).runs()
    assert [(r["config_hash"], r["status"]) for r in runs] == [(cell.hash, "error"),
                                                               (cell.hash, "ok")]


def _dry_run(db: Path, spec: Path, retry: str, capsys) -> str:
    assert main(["--db", str(db), "grid", str(spec), "--dry-run", "--retry", retry]) == 0
    return capsys.readouterr().out


def test_failed_cells_are_told_the_command_that_reruns_them(tmp_path):
    from argparse import Namespace

    from memstudy.cli import rerun_advice

    args = Namespace(db="r.sqlite", spec="s.toml")
    (line,) = rerun_advice({1: "error in timeout", 2: "oom in backward", 3: "ok"}, args)
    assert "memstudy --db r.sqlite grid s.toml --retry oom,timeout --timeout" in line
    assert rerun_advice({1: "ok", 2: "recorded earlier (skipped)"}, args) == []


def test_an_older_record_of_a_cell_is_named_with_what_differs(tmp_path):
    db = ResultsDB(tmp_path / "r.sqlite")
    spec = write_spec(tmp_path, [192])
    (cell,) = expand(load_spec(spec))
    older = resolved(cell.config).to_dict()
    del older["train"]["loss_chunk_rows"]  # a setting an older memstudy did not have
    fake_run(db, "0123456789abcdef", config=older)
    (outcome,) = plan_outcomes([cell], db).values()
    assert outcome.startswith("to run; reruns: run #1 recorded this cell under hash "
                              "0123456789abcdef"), outcome
    assert "train.loss_chunk_rows (absent then)" in outcome and cell.hash in outcome


# ------------------------------------------------------------------ the store: what a record holds
def _full_record(**changes) -> RunRecord:
    """A record with every field set, its config's keys out of order and a value JSON lacks."""
    fields = dict(
        config={"world_size": 2, "train": {"image_size": 256, "batch_size": 3},
                "techniques": ["amp:bf16"]},
        config_hash="h", name="amp:bf16", status="oom", label="lab", failed_phase="backward",
        error="OutOfMemoryError", started_at=10.0, finished_at=12.5, run_uid="u1", trained=False,
        env={"gpu_name": "Mock GPU", "device": torch.device("cuda", 1)},
        metrics=[(0, "forward", "peak", 5), (1, "step", "none", None)],
        epochs=[{"rank": 1, "epoch": 0, "steps": 4, "train_loss": 0.5, "val_loss": 0.25,
                 "val_ssim": 0.75, "val_psnr": 30.0, "time_s": 2.0, "val_dice": 0.625,
                 "val_iou": 0.375},
                {"epoch": 1, "steps": 4, "time_s": 1.5}],  # rank 0; no losses or scores
        series=[(1, 0, "loss", 0.25), (0, 3, "loss", 0.125), (0, 1, "lr", 1)])
    return RunRecord(**{**fields, **changes})


def test_a_record_is_stored_field_by_field_and_read_back(tmp_path):
    db = ResultsDB(tmp_path / "r.sqlite")
    run_id = db.record(_full_record())
    (row,) = db.runs()
    assert row == {
        "id": run_id, "config_hash": "h", "name": "amp:bf16", "label": "lab", "status": "oom",
        "failed_phase": "backward", "error": "OutOfMemoryError", "image_size": 256,
        "batch_size": 3, "world_size": 2, "device": "cuda:1", "gpu_name": "Mock GPU",
        "started_at": 10.0, "finished_at": 12.5, "trained": 0, "run_uid": "u1",
        "config_json": '{"techniques": ["amp:bf16"], "train": {"batch_size": 3, '
                       '"image_size": 256}, "world_size": 2}',
        "env_json": '{"device": "cuda:1", "gpu_name": "Mock GPU"}'}
    assert db.runs("oom") == [row] and db.runs("ok") == []
    assert db.metrics(run_id) == {(0, "forward"): {"peak": 5.0}, (1, "step"): {"none": None}}
    assert db.epochs(run_id) == [
        {"run_id": run_id, "rank": 0, "epoch": 1, "steps": 4, "train_loss": None,
         "val_loss": None, "val_ssim": None, "val_psnr": None, "time_s": 1.5, "val_dice": None,
         "val_iou": None},
        {"run_id": run_id, "rank": 1, "epoch": 0, "steps": 4, "train_loss": 0.5,
         "val_loss": 0.25, "val_ssim": 0.75, "val_psnr": 30.0, "time_s": 2.0, "val_dice": 0.625,
         "val_iou": 0.375}]
    assert [(r["rank"], r["step"], r["name"], r["value"]) for r in db.series(run_id)] == [
        (0, 1, "lr", 1.0), (0, 3, "loss", 0.125), (1, 0, "loss", 0.25)]
    assert [r["step"] for r in db.series(run_id, "lo%")] == [3, 0]
    # a config without world_size is one process; a run not judged stores no verdict
    other = db.record(_full_record(config={"train": {"image_size": 64, "batch_size": 1}},
                                   run_uid="u2", config_hash="g", trained=None, status="ok"))
    assert (db.runs("ok")[0]["world_size"], db.runs("ok")[0]["trained"]) == (1, None)
    assert db.recorded_hashes() == {"h", "g"} and db.metrics(other) == db.metrics(run_id)
    with pytest.raises(ValueError) as info:
        db.record(_full_record(status="crashed"))
    assert str(info.value) == ("status 'crashed' is not one of ('ok', 'oom', 'error', "
                               "'diverged')")


@pytest.mark.parametrize("status, phase, trained, said", [
    ("ok", None, None, "ok"), ("ok", None, True, "ok"), ("ok", None, 0, "ok, did not train"),
    ("oom", "forward", None, "oom in forward"),
    ("error", "setup", False, "error in setup, did not train"),
])
def test_an_outcome_in_a_few_words(status, phase, trained, said):
    from memstudy.store import describe_outcome

    assert describe_outcome(status, phase, trained) == said


def test_the_database_is_memstudy_db_or_the_default(monkeypatch):
    from memstudy.store import default_db_path

    monkeypatch.delenv("MEMSTUDY_DB", raising=False)
    assert default_db_path() == "results/memstudy.sqlite"
    monkeypatch.setenv("MEMSTUDY_DB", "/data/r.sqlite")
    assert default_db_path() == "/data/r.sqlite"


@pytest.mark.parametrize("sqlite_says, line", [
    ("database is locked", "is locked by another process (waited 60 s); wait for it to finish "
                           "or pass another --db"),
    ("database is busy", "is locked by another process (waited 60 s); wait for it to finish or "
                         "pass another --db"),
    ("attempt to write a readonly database", "is read-only; make it and its folder writable or "
                                             "pass another --db"),
    ("file is read-only", "is read-only; make it and its folder writable or pass another --db"),
    ("file is not a database", "is not a memstudy results database (or is damaged); pass "
                               "another --db"),
    ("database disk image is malformed", "is not a memstudy results database (or is damaged); "
                                         "pass another --db"),
    ("unable to open database file", "cannot be opened; check that its folder exists and is "
                                     "writable"),
    ("disk I/O error", "failed: disk I/O error"),
])
def test_an_sqlite_failure_is_one_line_saying_what_to_do(sqlite_says, line):
    from memstudy.store import explain

    err = explain(Path("/x/r.sqlite"), sqlite3.OperationalError(sqlite_says))
    assert str(err) == f"/x/r.sqlite {line} (SQLite: {sqlite_says})"


def test_files_that_are_no_database_are_refused_in_exact_lines(tmp_path, monkeypatch):
    import memstudy.store as store

    def refusal(path: Path) -> str:
        with pytest.raises(DatabaseError) as info:
            ResultsDB(path)
        return str(info.value)

    assert refusal(tmp_path) == f"{tmp_path} is not a file; pass a results database (--db) or a new path"
    empty = tmp_path / "empty.sqlite"
    empty.write_bytes(b"")
    assert refusal(empty) == (f"{empty} is an empty file, not a memstudy results database; "
                              "remove it or pass another --db (a new path is created)")
    text = tmp_path / "notes.sqlite"
    text.write_bytes(b"0123456789abcdef")
    assert refusal(text) == (f"{text} is not an SQLite database (it starts with "
                             "b'01234567'); pass a memstudy results database or a new path (--db)")
    damaged = tmp_path / "damaged.sqlite"
    damaged.write_bytes(store.SQLITE_HEADER + bytes(4096))
    assert refusal(damaged) == (f"{damaged} is not a memstudy results database (or is damaged); "
                                "pass another --db (SQLite: file is not a database)")
    missing = tmp_path / "missing.sqlite"
    with pytest.raises(DatabaseError) as info:
        ResultsDB(missing, create=False)
    assert str(info.value) == (f"results database {missing} not found; run a grid first or pass "
                               "--db / set MEMSTUDY_DB")

    def denied(path, mode="r"):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(store, "open", denied, raising=False)
    assert refusal(text) == f"cannot read {text} (Permission denied); check its permissions"


def test_a_new_database_makes_its_folders_or_says_why_not(tmp_path, monkeypatch):
    nested = tmp_path / "a" / "b" / "r.sqlite"
    assert ResultsDB(nested).runs() == [] and nested.is_file()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DatabaseError) as info:
        ResultsDB(blocker / "sub" / "r.sqlite")
    assert str(info.value) == (f"cannot create the folder of {blocker / 'sub' / 'r.sqlite'} "
                               "(Not a directory); pass a --db in a writable folder")

    def cannot_open(*args, **kwargs):
        raise sqlite3.OperationalError("unable to open database file")

    monkeypatch.setattr(sqlite3, "connect", cannot_open)
    with pytest.raises(DatabaseError) as info:
        ResultsDB(tmp_path / "new.sqlite")
    assert str(info.value) == (f"cannot create {tmp_path / 'new.sqlite'} (unable to open database "
                               "file); pass a --db in a writable folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "file"]  # no scratch file left


def _maxres_row(**changes) -> dict:
    row = {c: 0 for c in ("budget_bytes", "batch_size", "created_at")} | {
        "config_key": "k", "name": "original", "techniques_json": "[]", "budget": "1GiB",
        "device": "cpu", "gpu_name": None, "fit_sizes_json": "[]", "fit_phase": None,
        "fit_a": None, "fit_b": None, "predicted_px": None, "found_px": None,
        "step_time_s": None, "peak_bytes": None, "probes_json": "[]", "error": None}
    return row | changes


def test_a_maxres_result_replaces_the_earlier_one_of_its_config(tmp_path):
    db = ResultsDB(tmp_path / "r.sqlite")
    db.replace_maxres(_maxres_row(found_px=512))
    db.replace_maxres(_maxres_row(config_key="other", found_px=256))
    db.replace_maxres(_maxres_row(found_px=640))
    assert [(r["config_key"], r["found_px"]) for r in db.query(
        "SELECT * FROM maxres ORDER BY config_key")] == [("k", 640), ("other", 256)]
    row = _maxres_row()
    del row["fit_a"], row["error"]
    with pytest.raises(ValueError) as info:
        db.replace_maxres(row)
    assert str(info.value) == "maxres row lacks ['error', 'fit_a']"


def test_check_writable_refuses_what_no_run_could_be_stored_in(tmp_path, monkeypatch):
    import memstudy.store as store

    monkeypatch.setenv("MEMSTUDY_DB", str(tmp_path / "default-never-made.sqlite"))
    store.check_writable(tmp_path / "a" / "b" / "r.sqlite")  # folders made on first use
    older = tmp_path / "older.sqlite"  # an older memstudy's database: checked, not changed
    with sqlite3.connect(older) as con:
        con.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY)")
    con.close()
    before = older.read_bytes()
    store.check_writable(older)
    assert older.read_bytes() == before and not (tmp_path / "default-never-made.sqlite").exists()
    monkeypatch.setattr(store.os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(DatabaseError) as info:
        store.check_writable(tmp_path / "x" / "r.sqlite")
    assert str(info.value) == (f"cannot write in {tmp_path}, the folder of {tmp_path / 'x' / 'r.sqlite'} "
                               "(SQLite keeps its journal beside the database); make it writable "
                               "or pass another --db")


def test_a_record_the_database_cannot_take_is_kept_beside_it_or_in_the_temporary_folder(
        tmp_path, monkeypatch):
    import tempfile

    from memstudy.store import keep_aside

    rec = _full_record(run_uid="0123456789abcdef")
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = blocker / "r.sqlite"  # its folder cannot be made: the temporary folder instead
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    side = tmp_path / "r.unstored-0123456789ab.sqlite"
    assert keep_aside(rec, path) == (f"the run's record is kept in {side}; once {path} can be "
                                     f"written, add it with `memstudy --db {path} merge {side}`")
    assert [r["run_uid"] for r in ResultsDB(side).runs()] == ["0123456789abcdef"]
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(blocker))
    assert keep_aside(rec, path) == (f"the run's record could not be kept beside {path} either "
                                     f"(nor in {blocker})")


# ------------------------------------------------------------------ merge
def test_merging_twice_or_into_itself_adds_nothing(tmp_path, capsys):
    src, target = ResultsDB(tmp_path / "a.sqlite"), tmp_path / "all.sqlite"
    fake_run(src, "h1")
    fake_run(src, "h2", status="oom")
    src.replace_maxres({c: 0 for c in ("budget_bytes", "batch_size", "created_at")} | {
        "config_key": "k", "name": "original", "techniques_json": "[]", "budget": "1GiB",
        "device": "cpu", "gpu_name": None, "fit_sizes_json": "[]", "fit_phase": None,
        "fit_a": None, "fit_b": None, "predicted_px": None, "found_px": None,
        "step_time_s": None, "peak_bytes": None, "probes_json": "[]", "error": None})
    assert main(["--db", str(target), "merge", str(src.path)]) == 0
    assert "copied 2 runs" in capsys.readouterr().out
    assert main(["--db", str(target), "merge", str(src.path)]) == 0
    assert "nothing copied; all 2 of its runs are in" in capsys.readouterr().out
    merged = ResultsDB(target)
    assert len(merged.runs()) == 2 and len(merged.query("SELECT * FROM maxres")) == 1
    assert len(merged.query("SELECT * FROM metrics")) == 4
    assert main(["--db", str(target), "merge", str(target)]) == 2
    one_error_line(capsys.readouterr().err, "is the target database itself")
    assert len(ResultsDB(target).runs()) == 2


def test_runs_recorded_before_run_ids_merge_once_by_hash_and_start(tmp_path):
    old = ResultsDB(tmp_path / "old.sqlite")
    fake_run(old, "h1", started_at=1000.5)
    with sqlite3.connect(old.path) as con:  # as an older memstudy wrote it: no run id
        con.execute("UPDATE runs SET run_uid = NULL")
    target = tmp_path / "all.sqlite"
    assert [c for _s, c, _k in merge_databases(target, [old.path])] == [1]
    assert [(c, k) for _s, c, k in merge_databases(target, [old.path])] == [(0, 1)]
    assert len(ResultsDB(target).runs()) == 1


def test_a_merge_renumbers_the_runs_and_brings_their_rows_not_the_claims(tmp_path):
    target = ResultsDB(tmp_path / "all.sqlite")
    fake_run(target, "mine")  # run 1 of the target
    mine = target.metrics(1)
    src = ResultsDB(tmp_path / "a.sqlite")
    src.record(_full_record())  # run 1 of the source too
    assert claims.claim(src, "cell", Runner("host", 1, 0.0)) is None  # in flight: not a result
    src.replace_maxres(_maxres_row())
    assert [(c, k) for _s, c, k in merge_databases(target.path, [src.path])] == [(1, 0)]
    first, second = target.runs()
    assert (first["id"], first["config_hash"], second["id"]) == (1, "mine", 2)
    assert {k: v for k, v in second.items() if k != "id"} == {
        k: v for k, v in src.runs()[0].items() if k != "id"}
    assert target.metrics(1) == mine and target.metrics(2) == src.metrics(1)
    assert [{**e, "run_id": 1} for e in target.epochs(2)] == src.epochs(1)
    assert [{**r, "run_id": 1} for r in target.series(2)] == list(src.series(1))
    assert target.query("SELECT * FROM claims") == []
    assert target.query("SELECT * FROM maxres") == src.query("SELECT * FROM maxres")
    assert [(c, k) for _s, c, k in merge_databases(target.path, [src.path])] == [(0, 1)]


def test_a_source_from_before_run_ids_merges_once_and_is_left_as_it_was(tmp_path):
    old = ResultsDB(tmp_path / "old.sqlite")
    fake_run(old, "h1", started_at=1000.5)
    with sqlite3.connect(old.path) as con:  # as an older memstudy made it: no run_uid column
        kept = ", ".join(c for c in old.runs()[0] if c != "run_uid")
        con.execute("PRAGMA legacy_alter_table = ON")  # metrics keep referring to runs
        con.execute("ALTER TABLE runs RENAME TO newer")
        con.execute(f"CREATE TABLE runs AS SELECT {kept} FROM newer")
        con.execute("DROP TABLE newer")
    con.close()
    before = old.path.read_bytes()
    target = tmp_path / "all.sqlite"
    assert [(c, k) for _s, c, k in merge_databases(target, [old.path])] == [(1, 0)]
    assert [(c, k) for _s, c, k in merge_databases(target, [old.path])] == [(0, 1)]
    assert [r["run_uid"] for r in ResultsDB(target).runs()] == [None]
    assert old.path.read_bytes() == before  # read, never migrated


def test_merging_the_target_into_itself_is_refused_also_through_a_link(tmp_path):
    target = ResultsDB(tmp_path / "all.sqlite")
    fake_run(target, "h1")
    linked = tmp_path / "linked.sqlite"
    os.link(target.path, linked)
    for same in (target.path, linked):
        with pytest.raises(DatabaseError) as info:
            merge_databases(target.path, [same])
        assert str(info.value) == (f"{same} is the target database itself; nothing to merge "
                                   "(pass another database to copy from)")
    assert len(target.runs()) == 1


# ------------------------------------------------------------------ one-line errors, files kept
@pytest.mark.parametrize("content", [b"", np.random.default_rng(0).bytes(4096), "foreign"])
def test_a_file_that_is_no_results_database_is_refused_and_left_as_it_was(tmp_path, capsys,
                                                                          content):
    path = tmp_path / "results.sqlite"
    if content == "foreign":  # another program's SQLite database
        with sqlite3.connect(path) as con:
            con.execute("CREATE TABLE notes (text TEXT)")
        con.close()
    else:
        path.write_bytes(content)
    before = path.read_bytes()
    commands = [["report", str(path)], ["--db", str(path), "run", "--steps", "1"],
                ["--db", str(tmp_path / "t.sqlite"), "merge", str(path)]]
    for command in commands:
        assert main(command) == 2, command
        one_error_line(capsys.readouterr().err, str(path))
    assert path.read_bytes() == before
    with pytest.raises(DatabaseError, match="another program|empty file|not an SQLite"):
        ResultsDB(path)


def test_report_into_a_missing_folder_is_one_error_and_creates_nothing(tmp_path, capsys):
    db = ResultsDB(tmp_path / "r.sqlite")
    fake_run(db, "h1")
    out = tmp_path / "missing" / "report.md"
    assert main(["report", str(db.path), "--format", "md", "--out", str(out)]) == 2
    one_error_line(capsys.readouterr().err, str(out), "mkdir -p")
    assert not out.parent.exists()


def test_a_closed_output_pipe_is_one_error_line(tmp_path):
    db = ResultsDB(tmp_path / "r.sqlite")
    fake_run(db, "h1")
    read, write = os.pipe()
    os.close(read)  # the reader (e.g. head) is gone before memstudy writes
    proc = subprocess.run([sys.executable, "-m", "memstudy", "report", str(db.path)],
                          stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert proc.returncode == 2
    one_error_line(proc.stderr, "pipe was closed")


# ------------------------------------------------------------------ budgets refused up front
RUN = ["run", "--size", "192", "--steps", "1", "--device", "cpu", "--set", "data.train_images=1",
       "--set", "data.val_images=1", "--set", "train.validate=false", "--set",
       "train.warmup_steps=0", "-q"]


@pytest.mark.parametrize("budget, message", [("0", "holds nothing"),
                                              ("50MiB", "cannot hold the model's parameters")])
def test_a_budget_that_holds_nothing_is_refused_before_training(tmp_path, capsys, monkeypatch,
                                                                budget, message):
    import memstudy.runner as runner_mod

    def no_build(plan):
        raise AssertionError("the pipeline was built for a refused budget")
    monkeypatch.setattr(runner_mod, "build_pipeline", no_build)
    db = tmp_path / "r.sqlite"
    assert main(["--db", str(db), *RUN, "--budget", budget]) == 2
    one_error_line(capsys.readouterr().err, message, "--budget")
    assert ResultsDB(db).runs() == []


def test_a_grid_cell_with_budget_zero_is_invalid(tmp_path):
    (cell,) = expand(load_spec(write_spec(tmp_path, [192], budget=0)))
    assert cell.error and "holds nothing" in cell.error


# ------------------------------------------------------------------ folder images
def test_an_invalid_vr_dicom_is_listed_among_all_bad_files(tmp_path):
    from pydicom.data import get_testdata_file

    from memstudy.config import DataConfig
    from memstudy.datasets import build_datasets
    from memstudy.datasets.folder import ImageError

    rng = np.random.default_rng(0)
    for i in range(3):
        cv2.imwrite(str(tmp_path / f"img_{i}.png"), rng.integers(0, 255, (200, 200), np.uint8))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    (tmp_path / "badVR.dcm").write_bytes(Path(get_testdata_file("badVR.dcm")).read_bytes())
    with pytest.raises(ImageError) as info, pytest.warns(UserWarning, match="Invalid value"):
        build_datasets(DataConfig("folder", str(tmp_path), train_images=3, val_images=2),
                       "native")
    lines = str(info.value).splitlines()
    assert lines[0] == "2 of 5 images cannot be used:", lines
    assert any("badVR.dcm" in line and "invalid literal for int()" in line for line in lines)
    assert any("broken.png" in line for line in lines)


# ------------------------------------------------------------------ report spellings
def test_report_rows_merge_spellings_of_one_technique_set(tmp_path):
    db = ResultsDB(tmp_path / "r.sqlite")
    canonical = ["checkpoint:placement=block:segments=0", "amp:dtype=bf16:init_scale=65536.0"]
    fake_run(db, "h", name="amp:bf16+checkpoint", techniques=canonical)
    fake_run(db, "h", name="checkpoint+amp:bf16", techniques=canonical)
    fake_run(db, "o", name="original")
    rows = report.phase_memory(db)
    assert [(r["name"], r["runs"]) for r in rows] == [("original", 1), ("amp:bf16+checkpoint", 2)]
    text = report.build_report(db, "md")
    assert ("note: amp:bf16+checkpoint is also recorded as checkpoint+amp:bf16: the same "
            "technique set spelled differently") in text


# ------------------------------------------------------------------ pinned config hashes
def _config(device: str, techniques=(), size=256, batch=1, budget=None) -> RunConfig:
    cfg = RunConfig(techniques=list(techniques), budget=budget)
    cfg.train.device, cfg.train.image_size, cfg.train.batch_size = device, size, batch
    return cfg


@pytest.mark.parametrize("config, digest", [
    (_config("cpu"), "8c8584c4846f8ba6"),
    (_config("cuda", ["amp:bf16", "checkpoint"], 4188, 2), "53cf3ecffade1403"),
    (_config("cuda", ["checkpoint", "amp:dtype=bf16"], 4188, 2), "53cf3ecffade1403"),
    (_config("cpu", [], "512x384", 1, "4GiB"), "f2187c5844221978"),
])
def test_config_hashes_are_pinned(config, digest):
    """These runs are recorded under these hashes: a change that alters one would make every
    database rerun them. Make it on purpose: raise config.HASH_SCHEMA and renew the values."""
    config.label = "labels are not hashed"
    assert config_hash(config) == digest
