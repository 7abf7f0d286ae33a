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


def _loss_shapes(monkeypatch) -> list[tuple]:
    """The shapes the segmentation loss sees (output, mask)."""
    from memstudy import quality

    seen, compute = [], quality.SegmentLoss.compute

    def spy(self, out, target, rows):
        seen.append((tuple(out.shape), tuple(target.shape), target.dtype))
        return compute(self, out, target, rows)

    monkeypatch.setattr(quality.SegmentLoss, "compute", spy)
    return seen


def test_segmentation_on_phantom_masks_stores_dice_and_iou(make_config, monkeypatch, tmp_path):
    """Four classes at 72 x 100 px (padded to 96 x 128 inside the network): the loss sees the
    real pixels only, and every epoch stores Dice and IoU instead of SSIM and PSNR."""
    import torch

    from memstudy.runner import execute

    seen = _loss_shapes(monkeypatch)
    cfg = make_config("72x100", task="segment", epochs=2)
    cfg.model.classes = 4
    db = ResultsDB(tmp_path / "r.sqlite")
    rec = execute(cfg, db)
    assert rec.status == "ok", rec.error
    assert set(seen) == {((1, 4, 72, 100), (1, 1, 72, 100), torch.uint8)}
    (run,) = db.runs()
    epochs = db.epochs(run["id"])
    assert len(epochs) == 2
    for row in epochs:
        assert 0 <= row["val_iou"] <= row["val_dice"] <= 1 and row["val_loss"] > 0
        assert row["val_ssim"] is None and row["val_psnr"] is None
    assert rec.env["data"]["mask_classes"] == 4
    forward = db.metrics(run["id"])[(0, "forward")]
    assert forward["cat_loss_saved_bytes"] > 0  # the loss's saved logits and mask, metered


def test_segmentation_on_an_image_mask_folder(make_config, tmp_path):
    """Binary masks saved as 0 / 255 PNGs beside 16-bit PNG images, each at its native size."""
    import cv2
    import numpy as np

    from memstudy.runner import execute

    rng = np.random.default_rng(1)
    for i in range(3):
        image = rng.integers(0, 65535, (48, 70), dtype=np.uint16)
        for folder, pixels in (("images", image), ("masks", (image > 30000).astype(np.uint8) * 255)):
            (tmp_path / "data" / folder).mkdir(parents=True, exist_ok=True)
            assert cv2.imwrite(str(tmp_path / "data" / folder / f"scan_{i}.png"), pixels)
    cfg = make_config("native", task="segment")
    cfg.data.source, cfg.data.path = "folder", str(tmp_path / "data")
    rec = execute(cfg, None)
    assert rec.status == "ok", rec.error
    (epoch,) = rec.epochs
    assert 0 <= epoch["val_iou"] <= epoch["val_dice"] <= 1
    assert rec.env["data"]["val_native_shapes"] == {"48x70": 1}


def test_segmentation_refuses_a_mismatched_mask_before_training(make_config, tmp_path):
    import cv2
    import numpy as np

    from memstudy.datasets import ImageError
    from memstudy.runner import execute

    for i, shape in enumerate([(48, 70), (48, 70), (48, 60)]):
        (tmp_path / "images").mkdir(exist_ok=True)
        (tmp_path / "masks").mkdir(exist_ok=True)
        cv2.imwrite(str(tmp_path / "images" / f"s{i}.png"), np.arange(48 * 70, dtype=np.uint16).reshape(48, 70))
        cv2.imwrite(str(tmp_path / "masks" / f"s{i}.png"), np.zeros(shape, np.uint8))
    cfg = make_config("native", task="segment")
    cfg.data.source, cfg.data.path = "folder", str(tmp_path)
    db = ResultsDB(tmp_path / "r.sqlite")
    with pytest.raises(ImageError, match=r"s2.png: mask is 48x60 px .* its input s2.png is 48x70"):
        execute(cfg, db)
    assert db.runs() == []  # refused before anything was recorded


@pytest.mark.slow
def test_segmenting_phantom_lungs_learns(make_config):
    """The lung fields of four 96 px phantoms: validation Dice rises from chance to most of the
    lungs in six epochs (measured 0.19 -> 0.83; eval-mode BatchNorm lags the first epochs)."""
    cfg = make_config(96, epochs=6, lr=3e-3, task="segment")
    cfg.data.train_images, cfg.data.val_images = 4, 2
    cfg.meter.tensor = "off"
    from memstudy.runner import execute

    rec = execute(cfg, db=None)
    assert rec.status == "ok", rec.error
    dice = [e["val_dice"] for e in rec.epochs]
    assert dice[-1] > 0.5 and dice[-1] > dice[0] + 0.3, dice
    assert rec.epochs[-1]["train_loss"] < rec.epochs[0]["train_loss"] / 2
