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
    assert claims.claim(db, "c", far) is None
    assert isinstance(claims.claim(db, "c", me), Holder)
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
