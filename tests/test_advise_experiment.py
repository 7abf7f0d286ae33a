"""advise --check matches a prediction with later runs of its own experiment (issue 39): a
later run of the same set and size under other settings (data, network, ...) is not used and
the check says what differs; a prediction stored before advise kept its experiment is matched
as then, and says so in one line."""
from __future__ import annotations

import time

import pytest

from memstudy import advise
from memstudy.cli import main
from memstudy.store import PREDICTIONS_SCHEMA, ResultsDB, merge_databases
from test_report_decide import db, gpu_run  # noqa: F401 (db: the fixture database)


class Varied:
    """A database whose recorded runs hold other settings (gpu_run through it)."""

    def __init__(self, db: ResultsDB, **sections: dict):  # noqa: F811
        self.db, self.sections = db, sections

    def record(self, rec) -> int:
        for section, values in self.sections.items():
            rec.config.setdefault(section, {}).update(values)
        return self.db.record(rec)


def last_run_id(db) -> int:  # noqa: F811
    return db.runs()[-1]["id"]


def advise_768(db, capsys) -> None:  # noqa: F811
    assert main(["--db", str(db.path), "advise", "--budget", "4GiB", "--size", "768"]) == 0
    capsys.readouterr()
    time.sleep(0.01)  # the runs below finish after the predictions


def test_check_uses_only_runs_of_the_predictions_experiment_and_names_the_others(db, capsys):  # noqa: F811
    advise_768(db, capsys)
    gpu_run(db, "amp", 768, 1500, 0.10, budget="4GiB")  # its experiment: 2300 MB measured
    same = last_run_id(db)
    gpu_run(Varied(db, data={"train_images": 6}), "amp", 768, 900, 0.05, budget="4GiB")  # latest
    other = last_run_id(db)
    gpu_run(Varied(db, model={"encoder": "resnet18"}), "checkpoint", 768, 500, 0.3, budget="4GiB")
    net = last_run_id(db)
    amp, ckpt = advise.check(db)
    assert amp["name"] == "amp" and amp["run"] == same and amp["keyed"]
    assert amp["measured_mb"] == pytest.approx(2300)  # not the other run's 1700
    assert amp["not_used"] == [f"run {other} (data.train_images=6; predicted for "
                               "data.train_images=48)"]
    # checkpoint's only later run is of another network: a row without a run, saying why
    assert ckpt["run"] is None and ckpt["status"] == "no run of its experiment"
    assert ckpt["fit_call"] == "-" and ckpt["measured_mb"] is None
    assert ckpt["not_used"] == [f"run {net} (model.encoder=resnet18; predicted for "
                                "model.encoder=resnet34)"]
    assert main(["--db", str(db.path), "advise", "--check"]) == 0
    out = capsys.readouterr().out
    assert (f"prediction {amp['prediction']} (amp at 768 px): not used, another experiment: "
            f"run {other} (data.train_images=6; predicted for data.train_images=48)") in out
    assert "no experiment key" not in out


def test_a_setting_added_after_the_prediction_reads_as_its_default(db, capsys):  # noqa: F811
    """A prediction stored before data.train_images existed (its key without it) is of the
    runs at that setting's default, not of the others."""
    advise_768(db, capsys)
    with db.transaction() as con:
        for pid, key in con.execute("SELECT id, experiment FROM predictions").fetchall():
            con.execute("UPDATE predictions SET experiment = ? WHERE id = ?",
                        (key.replace('"data.train_images": "48", ', ""), pid))
    gpu_run(Varied(db, data={"train_images": 48}), "amp", 768, 1500, 0.10, budget="4GiB")
    same = last_run_id(db)
    gpu_run(Varied(db, data={"train_images": 6}), "amp", 768, 900, 0.05, budget="4GiB")
    (row,) = advise.check(db)
    assert row["run"] == same and row["keyed"]
    assert row["not_used"] == [f"run {last_run_id(db)} (data.train_images=6; predicted for "
                               "data.train_images=48)"]


def test_a_prediction_stored_before_keys_is_matched_as_then_and_marked(tmp_path, db, capsys):  # noqa: F811
    """A database whose predictions table an older advise made (no experiment column)."""
    old_schema = PREDICTIONS_SCHEMA.replace(
        "confidence TEXT NOT NULL,", "confidence TEXT NOT NULL").split("    experiment TEXT")[0]
    with db.transaction() as con:
        con.execute(old_schema + ")")
        con.execute("INSERT INTO predictions (created_at, gpu_name, name, image_size, "
                    "batch_size, budget, budget_bytes, fits, peak_bytes, step_time_s, confidence) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?)", (time.time(), "Test GPU 80GB", "amp", "768",
                                                       1, "4GiB", 4 * 1024**3, 1, 1700 * 1024**2,
                                                       0.12, "interpolated 512-1024 px"))
    time.sleep(0.01)
    gpu_run(Varied(db, data={"train_images": 6}), "amp", 768, 1500, 0.10, budget="4GiB")
    (row,) = advise.check(db)  # reading does not add the column
    assert row["run"] == last_run_id(db) and not row["keyed"] and row["not_used"] == []
    text = advise.check_table([row])
    (line,) = [ln for ln in text.splitlines() if "no experiment key" in ln]
    assert line.startswith(f"prediction {row['prediction']} (no experiment key: recorded before")
    # a newer advise adds the column to the older table; its predictions are keyed
    advise_768(db, capsys)
    gpu_run(db, "amp", 768, 1500, 0.10, budget="4GiB")
    old, new = advise.check(db)  # checkpoint's has no later run
    assert not old["keyed"] and new["keyed"] and new["run"] == last_run_id(db)
    assert new["not_used"] == []  # the other experiment's run finished before it
    # merging the keyed predictions into a database whose table is older keeps their keys
    target = ResultsDB(tmp_path / "old.sqlite")
    with target.transaction() as con:
        con.execute(old_schema + ")")
    merge_databases(target.path, [db.path])
    keys = [r["experiment"] for r in target.query("SELECT experiment FROM predictions")]
    assert len(keys) == 3 and keys[0] is None and '"data.train_images": "48"' in keys[1]
