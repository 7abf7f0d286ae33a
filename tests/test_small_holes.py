"""The smaller holes of issue 39: a grid whose cells failed says so in its exit status, a tiny
budget is named as written, sizes whose input alone cannot fit are refused up front."""
from __future__ import annotations

from memstudy.cli import main
from memstudy.store import ResultsDB
from test_records import RUN, one_error_line, write_spec


def test_a_grid_whose_cell_timed_out_exits_1_and_says_how_many(tmp_path, capsys, monkeypatch):
    from memstudy.grid import forkserver

    monkeypatch.setattr(forkserver, "ENABLED", False)  # a plain child, killed in its imports
    db = tmp_path / "r.sqlite"
    spec = write_spec(tmp_path, [192], timeout_s=0.5)
    assert main(["--db", str(db), "grid", str(spec), "-q"]) == 1
    err = capsys.readouterr().err
    assert "1 of the 1 cells run here ended in error, timeout or without a record" in err
    (run,) = ResultsDB(db).runs()
    assert run["failed_phase"] == "timeout"
    assert main(["--db", str(db), "grid", str(spec), "-q"]) == 0  # nothing run: nothing failed


def test_a_budget_of_1kb_is_named_as_written(tmp_path, capsys):
    assert main(["--db", str(tmp_path / "r.sqlite"), *RUN, "--budget", "1KB"]) == 2
    one_error_line(capsys.readouterr().err, "budget 1KiB cannot hold")
