"""Nothing trained to be lost: every command that writes refuses, before building anything, a
database (or an output file) it could not write, in one line naming the path; a run whose
store fails anyway (a full disk) is kept in a side database with the command that merges it."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from memstudy.cli import main
from memstudy.store import DatabaseError, ResultsDB, explain
from test_records import RUN, fake_run, one_error_line, write_spec

WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH


def _as_owner(path, mode, *args, **kwargs) -> bool:
    """os.access as the file's owner sees it: root may write anything, so under root the
    permission bits are read directly (what a user's own read-only file means)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    bits = {os.R_OK: stat.S_IRUSR, os.W_OK: stat.S_IWUSR, os.X_OK: stat.S_IXUSR}
    return all(st.st_mode & bit for flag, bit in bits.items() if mode & flag)


@pytest.fixture
def read_only(monkeypatch):
    """chmod a-w on the paths given; restored afterwards so the folder can be removed."""
    if os.geteuid() == 0:
        monkeypatch.setattr(os, "access", _as_owner)
    changed: list[tuple[Path, int]] = []

    def make(*paths: Path) -> None:
        for path in paths:
            changed.append((path, path.stat().st_mode))
            path.chmod(path.stat().st_mode & ~WRITE_BITS)
    yield make
    for path, mode in reversed(changed):
        path.chmod(mode)


@pytest.fixture
def nothing_built(monkeypatch):
    """Any command that got as far as building or training a run fails the test."""
    import memstudy.maxres
    import memstudy.runner

    def built(*args, **kwargs):
        raise AssertionError("a run was built for a database that cannot store it")
    monkeypatch.setattr(memstudy.runner, "execute", built)
    monkeypatch.setattr(memstudy.maxres, "search_all", built)


def writers(db: Path, tmp_path: Path) -> list[list[str]]:
    other = ResultsDB(tmp_path / "other.sqlite")
    fake_run(other, "h-other")
    return [["--db", str(db), *RUN],
            ["--db", str(db), "grid", str(write_spec(tmp_path, [192]))],
            ["--db", str(db), "maxres", "--budget", "1GiB", "--device", "cpu"],
            ["--db", str(db), "advise", "--budget", "1GiB", "--size", "256"],
            ["--db", str(db), "merge", str(other.path)]]


def test_a_read_only_database_is_refused_before_anything_is_built(tmp_path, capsys, read_only,
                                                                  nothing_built):
    db = ResultsDB(tmp_path / "r.sqlite")
    fake_run(db, "h1")
    read_only(db.path)
    for argv in writers(db.path, tmp_path):
        assert main(argv) == 2, argv
        one_error_line(capsys.readouterr().err, str(db.path), "read-only", "--db")
    assert len(db.runs()) == 1


@pytest.mark.parametrize("exists", [True, False])
def test_a_read_only_folder_is_refused_before_anything_is_built(tmp_path, capsys, read_only,
                                                                nothing_built, exists):
    folder = tmp_path / "results"
    folder.mkdir()
    db = folder / "r.sqlite"
    if exists:
        fake_run(ResultsDB(db), "h1")
    read_only(folder)
    for argv in writers(db, tmp_path):
        assert main(argv) == 2, argv
        one_error_line(capsys.readouterr().err, f"cannot write in {folder}", str(db))
    assert db.exists() == exists


def test_report_out_into_a_read_only_place_is_refused_before_the_report_is_built(
        tmp_path, capsys, read_only, monkeypatch):
    import memstudy.report

    db = ResultsDB(tmp_path / "r.sqlite")
    fake_run(db, "h1")
    monkeypatch.setattr(memstudy.report, "build_report", lambda *a, **k: pytest.fail("built"))
    shut = tmp_path / "shut"
    shut.mkdir()
    kept = tmp_path / "kept.md"
    kept.write_text("earlier report")
    read_only(shut, kept)
    for out in (shut / "report.md", kept):
        assert main(["report", str(db.path), "--out", str(out)]) == 2
        one_error_line(capsys.readouterr().err, f"--out {out}", "read-only")
    assert kept.read_text() == "earlier report" and not list(shut.iterdir())


def test_a_run_whose_store_fails_is_kept_beside_the_database_and_merges(tmp_path, capsys,
                                                                       monkeypatch):
    """A full disk at the moment of storing (simulated: the run's insert fails as SQLite
    reports it): the trained run goes to a side database, the error line says where
    and how to merge it, and the merge brings it in once."""
    import sqlite3

    db = ResultsDB(tmp_path / "r.sqlite")
    insert = ResultsDB._insert

    def full_disk(self, rec):
        if self.path == db.path:
            raise explain(self.path, sqlite3.OperationalError("database or disk is full"))
        return insert(self, rec)
    monkeypatch.setattr(ResultsDB, "_insert", full_disk)
    assert main(["--db", str(db.path), *RUN]) == 2
    line = one_error_line(capsys.readouterr().err, str(db.path), "disk is full", "kept in",
                          f"memstudy --db {db.path} merge")
    (side,) = tmp_path.glob("r.unstored-*.sqlite")
    assert str(side) in line
    (kept,) = ResultsDB(side, create=False).runs()
    assert kept["status"] == "ok" and kept["image_size"] == 192
    monkeypatch.setattr(ResultsDB, "_insert", insert)  # the disk has room again
    assert main(["--db", str(db.path), "merge", str(side)]) == 0
    assert [r["run_uid"] for r in db.runs()] == [kept["run_uid"]]


def test_advise_on_a_database_it_cannot_write_is_one_line_naming_it(tmp_path, capsys,
                                                                    read_only):
    db = ResultsDB(tmp_path / "r.sqlite")
    fake_run(db, "h1")
    read_only(db.path)
    assert main(["--db", str(db.path), "advise", "--budget", "1GiB", "--size", "256"]) == 2
    one_error_line(capsys.readouterr().err, str(db.path), "read-only")


def test_storing_predictions_in_a_read_only_database_is_the_stores_one_line(tmp_path,
                                                                          monkeypatch):
    """Past the check (the file made read-only meanwhile): SQLite's refusal comes out as the
    store's DatabaseError naming the file, as every other write does."""
    import sqlite3

    db = ResultsDB(tmp_path / "r.sqlite")
    read_only_uri = f"{db.path.resolve().as_uri()}?mode=ro"  # read-only whoever runs the test
    monkeypatch.setattr(ResultsDB, "_connect", lambda self: sqlite3.connect(read_only_uri, uri=True))
    with pytest.raises(DatabaseError, match=f"{db.path} is read-only"):
        db.add_predictions([])
