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


def test_a_size_whose_input_alone_exceeds_the_host_is_refused_and_never_recorded(
        tmp_path, capsys, monkeypatch):
    """--size 99999999 used to be recorded as an error run ('Unable to allocate 8.88 PiB');
    here the host holds 1 GiB, so 32768 px (4 GiB of float32 input) cannot even be made."""
    import memstudy.maxres
    import memstudy.runner
    import memstudy.image_sizes
    from memstudy.grid import expand, load_spec

    def built(*args, **kwargs):
        raise AssertionError("a run was started for a size whose input cannot be made")
    monkeypatch.setattr(memstudy.runner, "execute", built)
    monkeypatch.setattr(memstudy.maxres, "search_all", built)
    monkeypatch.setattr(memstudy.image_sizes, "host_memory_bytes", lambda: 2**30)
    db = tmp_path / "r.sqlite"
    huge = ["--size", "32768", "--steps", "1", "--device", "cpu", "--set", "data.train_images=1",
            "--set", "data.val_images=1", "--set", "train.warmup_steps=0", "-q"]
    assert main(["--db", str(db), "run", *huge]) == 2
    one_error_line(capsys.readouterr().err, "train.image_size 32768", "4GiB", "1GiB")
    assert main(["--db", str(db), "maxres", "--budget", "1GiB", "--device", "cpu",
                 "--max-size", "32768"]) == 2
    one_error_line(capsys.readouterr().err, "maxres --max-size 32768")
    (cell,) = expand(load_spec(write_spec(tmp_path, [32768])))  # a grid never runs it
    assert cell.error and cell.error.startswith("train.image_size 32768")
    assert not db.exists() or ResultsDB(db).runs() == []
