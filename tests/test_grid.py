"""Grid specs: expansion and validation; isolated cells, timeout, and resume after kills."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memstudy.cli import main
from memstudy.errors import ConfigError
from memstudy.grid import expand, load_spec, product_sets, run_grid, spec_from_dict, to_toml
from memstudy.store import ResultsDB

BASE = {"train": {"device": "cpu", "validate": False, "warmup_steps": 0, "measure_steps": 1},
        "data": {"train_images": 1, "val_images": 1}}


def write_spec(tmp_path: Path, sizes: list[int], **extra) -> Path:
    spec = {"name": "t", "image_sizes": sizes, "steps": 1, "base": BASE, **extra}
    path = tmp_path / "spec.toml"
    path.write_text(to_toml(spec))
    return path


def test_product_sets():
    assert product_sets({"amp": ["off", "bf16"], "checkpoint": ["off", "on"]}) == [
        [], ["checkpoint"], ["amp:bf16"], ["amp:bf16", "checkpoint"]]
    with pytest.raises(ConfigError, match="product.amp"):
        product_sets({"amp": []})


def test_expansion_reports_invalid_cells_with_their_reason():
    spec = spec_from_dict({"techniques": ["original", "nosuch:1", "none"], "image_sizes": [192, 100],
                           "seeds": [0, 1], "steps": 1, "base": BASE})
    cells = expand(spec)
    # 'none' is 'original' again: 2 technique sets x 2 sizes x 2 seeds
    assert len(cells) == 8
    valid = [c for c in cells if c.error is None]
    assert [(c.name, c.config.train.image_size, c.config.train.seed) for c in valid] == [
        ("original", 192, 0), ("original", 192, 1)]
    assert len({c.hash for c in valid}) == 2
    reasons = {c.error for c in cells if c.error}
    assert any("unknown technique 'nosuch'" in r for r in reasons)
    assert any("not a multiple of 32" in r for r in reasons)
    for c in cells:  # cell settings come from the spec, the rest from [base]
        assert c.config.train.max_steps == 1 and c.config.data.train_images == 1


def test_spec_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="unknown grid key"):
        spec_from_dict({"sizes": [256]})
    with pytest.raises(ConfigError, match="image_sizes"):
        spec_from_dict({"image_sizes": "256"})
    with pytest.raises(ConfigError, match="both epochs and steps"):
        spec_from_dict({"epochs": 1, "steps": 2})
    with pytest.raises(ConfigError, match="unknown key"):
        expand(spec_from_dict({"base": {"train": {"sizee": 1}}}))
    with pytest.raises(ConfigError, match="not found"):
        load_spec(tmp_path / "missing.toml")


def test_dry_run_runs_nothing(tmp_path, capsys):
    db = tmp_path / "r.sqlite"
    spec = write_spec(tmp_path, [192, 100])
    assert main(["--db", str(db), "grid", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "to run" in out and "invalid: train.image_size 100" in out
    assert ResultsDB(db).runs() == []


def test_timeout_is_recorded_and_not_rerun(tmp_path):
    db = tmp_path / "r.sqlite"
    spec = load_spec(write_spec(tmp_path, [192], timeout_s=0.5))
    result = run_grid(spec, db, poll_s=0.05)
    assert result.outcomes == {1: "error in timeout"}
    (run,) = ResultsDB(db).runs()
    assert (run["status"], run["failed_phase"]) == ("error", "timeout")
    assert run_grid(spec, db).outcomes == {1: "recorded earlier (skipped)"}
    assert len(ResultsDB(db).runs()) == 1


def _children(pid: int, running: str) -> list[int]:
    """Child processes of `pid` whose command line mentions `running` (a cell's hash)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and running in cmdline:
            found.append(int(stat.parent.name))
    return found


def _wait(condition, timeout: float = 120.0, what: str = ""):
    end = time.time() + timeout
    while time.time() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_resume_after_killing_a_cell_and_the_runner(tmp_path):
    db = tmp_path / "r.sqlite"
    spec_path = write_spec(tmp_path, [192, 224])
    cmd = [sys.executable, "-m", "memstudy", "--db", str(db), "grid", str(spec_path), "-q"]
    cell2 = expand(load_spec(spec_path))[1].hash

    def start_and_kill(kill_runner: bool) -> subprocess.Popen:
        runner = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _wait(lambda: len(ResultsDB(db).runs()) >= 1, what="cell 1 to be recorded")
        (child,) = _wait(lambda: _children(runner.pid, cell2), what="the child of cell 2")
        time.sleep(1.0)  # cell 2 is under way
        os.kill(runner.pid if kill_runner else child, signal.SIGKILL)
        runner.wait(timeout=120)
        _wait(lambda: not _alive(child), 30, "cell 2 to die with its runner")
        return runner

    # 1. SIGKILL cell 2's process: the runner reports it killed and records nothing for it
    runner = start_and_kill(kill_runner=False)
    assert runner.returncode == 1, runner.stdout.read()
    assert "killed by signal 9" in runner.stdout.read()
    assert [r["image_size"] for r in ResultsDB(db).runs()] == [192]
    # 2. a rerun skips cell 1; SIGKILL the runner while cell 2 runs: the cell dies with it
    start_and_kill(kill_runner=True)
    assert [r["image_size"] for r in ResultsDB(db).runs()] == [192]
    # 3. a rerun runs cell 2 only; no duplicate rows
    result = run_grid(load_spec(spec_path), db)
    assert result.outcomes == {1: "recorded earlier (skipped)", 2: "ok"}
    runs = ResultsDB(db).runs()
    assert sorted(r["image_size"] for r in runs) == [192, 224]
    assert len({r["config_hash"] for r in runs}) == 2


@pytest.mark.gpu
def test_gpu_cells_spread_over_visible_gpus(tmp_path):
    import torch

    gpu_base = {**BASE, "train": {**BASE["train"], "device": "cuda"}}
    spec = spec_from_dict({"image_sizes": [256, 512], "seeds": [0, 1], "steps": 2,
                           "base": gpu_base, "budget": "8GiB"})
    result = run_grid(spec, tmp_path / "r.sqlite")
    assert set(result.outcomes.values()) == {"ok"}
    runs = ResultsDB(tmp_path / "r.sqlite").runs()
    assert len(runs) == 4 and all(r["gpu_name"] for r in runs)
    if torch.cuda.device_count() >= 2:  # one cell per GPU at a time: cells overlapped in time
        spans = sorted((r["started_at"], r["finished_at"]) for r in runs)
        assert any(nxt[0] < cur[1] for cur, nxt in zip(spans, spans[1:]))
