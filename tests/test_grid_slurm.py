"""Grids as submitit jobs: each cell its own job and database, merged by the launcher alone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from memstudy.cli import main
from memstudy.errors import ConfigError
from memstudy.grid import expand, load_spec
from memstudy.grid.slurm import cell_databases, gather, jobs_folder, make_executor
from memstudy.store import ResultsDB, RunRecord
from test_grid import write_spec

pytest.importorskip("submitit")


def fake_cell_run(path, cell, status: str = "ok") -> None:
    """A cell's own database holding its run, as a job leaves it."""
    ResultsDB(path).record(RunRecord(config=cell.config.to_dict(), config_hash=cell.hash,
                                     name=cell.name, status=status, env={"device": "cpu"},
                                     started_at=0.0))


def test_gather_merges_a_finished_cell_once_and_drops_duplicates(tmp_path):
    db = tmp_path / "main.sqlite"
    cell = expand(load_spec(write_spec(tmp_path, [192])))[0]
    folder = jobs_folder(db)
    folder.mkdir(parents=True)
    assert gather(db, cell) is None  # no job has finished yet
    fake_cell_run(folder / f"{cell.hash}-1.sqlite", cell)
    fake_cell_run(folder / f"{cell.hash}-2.sqlite", cell)  # a resubmitted job finished too
    assert gather(db, cell) == "ok"
    assert [r["config_hash"] for r in ResultsDB(db).runs()] == [cell.hash]
    assert cell_databases(db, cell) == []  # merged, the duplicate discarded
    fake_cell_run(folder / f"{cell.hash}-3.sqlite", cell)  # an orphan job finishing later
    assert gather(db, cell) == "ok" and len(ResultsDB(db).runs()) == 1


def test_slurm_needs_a_partition_and_submitit(tmp_path, monkeypatch, capsys):
    spec = write_spec(tmp_path, [192])
    db = str(tmp_path / "r.sqlite")
    assert main(["--db", db, "grid", str(spec), "--launcher", "slurm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memstudy: error: --launcher slurm needs --partition") and err.count("\n") == 1
    monkeypatch.setitem(sys.modules, "submitit", None)  # as if not installed
    with pytest.raises(ConfigError, match="pip install submitit"):
        make_executor("slurm", tmp_path, "gpu")
    assert main(["--db", db, "grid", str(spec), "--launcher", "submitit-local"]) == 2
    assert "needs submitit: pip install submitit" in capsys.readouterr().err
    assert not os.path.exists(db)  # refused before anything was created


@pytest.mark.slow
def test_a_killed_launcher_loses_no_finished_cell_and_resumes_without_duplicates(tmp_path):
    """Every cell recorded through submitit's local executor, across a SIGKILLed launcher."""
    db = tmp_path / "r.sqlite"
    spec_path = write_spec(tmp_path, [192, 200])
    cmd = [sys.executable, "-m", "memstudy", "--db", str(db), "grid", str(spec_path),
           "--launcher", "submitit-local", "-q"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.time() + 300
    while time.time() < end and not (db.exists() and ResultsDB(db).runs()):
        time.sleep(0.2)
    os.kill(launcher.pid, signal.SIGKILL)  # with cell 2's job submitted or under way
    launcher.wait(timeout=60)
    assert [r["image_size"] for r in ResultsDB(db).runs()] == [192]
    rerun = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "recorded earlier (skipped): ok" in rerun.stdout
    runs = ResultsDB(db).runs()
    assert sorted(r["image_size"] for r in runs) == [192, 200]
    assert len({r["config_hash"] for r in runs}) == len(runs) == 2
    assert sorted(r["config_hash"] for r in runs) == sorted(c.hash for c in expand(load_spec(spec_path)))
