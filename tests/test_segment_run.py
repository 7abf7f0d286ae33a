"""Segmentation runs end to end: Dice / IoU stored per epoch (epochs.val_dice / val_iou, added
to older databases), phantom masks and an image / mask folder trained through `execute`."""
from __future__ import annotations

import sqlite3

import pytest

from memstudy.store import ResultsDB, RunRecord, merge_databases


def _record(key: str, epoch: dict) -> RunRecord:
    return RunRecord(config={"train": {"image_size": 64, "batch_size": 1}}, config_hash=key,
                     name="original", status="ok", env={"device": "cpu"}, started_at=0.0,
                     epochs=[{"epoch": 0, "steps": 2, "train_loss": 0.6, "time_s": 1.0,
                              "val_loss": 0.5, **epoch}])


def test_dice_and_iou_columns_are_added_to_an_older_database(tmp_path):
    old = tmp_path / "old.sqlite"
    ResultsDB(old).record(_record("enhance", {"val_ssim": 0.8, "val_psnr": 20.0}))
    con = sqlite3.connect(old)  # as an older memstudy left it: no val_dice / val_iou
    for column in ("val_dice", "val_iou"):
        con.execute(f"ALTER TABLE epochs DROP COLUMN {column}")
    con.commit()
    con.close()
    before = old.read_bytes()
    (read,) = ResultsDB(old, create=False).epochs(1)  # a reader changes nothing
    assert "val_dice" not in read and old.read_bytes() == before
    db = ResultsDB(old)  # a writer adds the columns: the older epochs hold NULL
    db.record(_record("segment", {"val_dice": 0.7, "val_iou": 0.55}))
    rows = [db.epochs(run["id"])[0] for run in db.runs()]
    assert [(r["val_ssim"], r["val_dice"], r["val_iou"]) for r in rows] == \
        [(0.8, None, None), (None, 0.7, 0.55)]
    merged = tmp_path / "merged.sqlite"
    merge_databases(merged, [old])
    copied = ResultsDB(merged)
    assert [copied.epochs(run["id"])[0]["val_dice"] for run in copied.runs()] == [None, 0.7]
