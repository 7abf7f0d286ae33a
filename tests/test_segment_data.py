"""Segmentation data: phantom masks of the structures the phantoms draw, image / mask folders
(images/ + masks/), and every pairing, size or value problem of a folder in one error."""
from __future__ import annotations

import re

import cv2
import numpy as np
import pytest
import torch

from memstudy.config import PHANTOM_CLASSES
from memstudy.datasets import (DataConfig, ImageError, build_datasets, describe_datasets,
                               load_mask, make_mask, make_phantom, phantom_layers)
from memstudy.errors import ConfigError

LUNG, HEART, BONE = (PHANTOM_CLASSES.index(name) for name in ("lung", "heart", "bone"))


# ---------------------------------------------------------------- phantom masks
def test_phantom_masks_are_deterministic_and_hold_the_documented_classes():
    mask = make_mask(128, seed=3, index=1)
    assert mask.dtype == np.uint8 and mask.shape == (128, 128)
    assert np.array_equal(mask, make_mask(128, seed=3, index=1))
    assert not np.array_equal(mask, make_mask(128, seed=3, index=2))
    assert set(np.unique(mask)) == set(range(len(PHANTOM_CLASSES)))
    binary = make_mask(128, seed=3, index=1, classes=1)
    assert set(np.unique(binary)) == {0, 1}
    # binary: the lung fields whole; several classes: bone and heart marked over the lungs
    assert np.all(binary[mask == LUNG] == 1) and (binary == 1).sum() > (mask == LUNG).sum()
    with pytest.raises(ValueError, match="1 class .* or 4"):
        make_mask(128, 0, 0, classes=3)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_phantom_masks_mark_what_the_image_shows(index):
    """Against the phantom's own noise-free layers: every bone-mask pixel holds bone, most dense
    bone is in the mask (anti-aliased edges aside), and the lung fields attenuate less than the
    rest of the torso (air)."""
    layers, mask = phantom_layers(256, 0, index), make_mask(256, 0, index)
    lungs = make_mask(256, 0, index, classes=1) == 1
    bone = mask == BONE
    assert np.all(layers.bone[bone] > 0)
    assert bone[layers.bone > 0.6].mean() > 0.9
    torso = layers.soft > 0.5 * layers.torso_peak
    assert layers.soft[lungs].mean() < 0.8 * layers.soft[torso & ~lungs].mean()


def test_phantom_masks_are_the_same_anatomy_at_every_size():
    def shrunk(mask):
        return cv2.resize(mask, (128, 128), interpolation=cv2.INTER_NEAREST)

    # thin ribs a pixel wide at 128 px differ at their edges: 0.94 of the pixels agree
    assert (make_mask(128, 0, 4) == shrunk(make_mask(512, 0, 4))).mean() > 0.9
    small, big = make_mask(128, 0, 4, 1) == 1, shrunk(make_mask(512, 0, 4, 1)) == 1
    assert (small & big).sum() / (small | big).sum() > 0.95  # the lung fields' IoU


def test_rectangular_phantom_mask_is_the_centre_of_the_square_one():
    square, rect = make_mask(160, 1, 2), make_mask((100, 160), 1, 2)
    assert np.array_equal(rect, square[30:130])
    assert make_phantom((100, 160), 1, 2).shape == rect.shape


def test_synthetic_segmentation_items_are_image_and_mask():
    train, val = build_datasets(DataConfig(train_images=2, val_images=1), 64,
                                task="segment", classes=len(PHANTOM_CLASSES))
    x, y = train[1]
    assert x.dtype == torch.float32 and x.shape == (1, 64, 64) and 0 <= x.min() < x.max() <= 1
    assert y.dtype == torch.uint8 and y.shape == (1, 64, 64)
    assert np.array_equal(y[0].numpy(), make_mask(64, 0, 1))
    assert np.array_equal(val[0][1][0].numpy(), make_mask(64, 0, 2))  # index after train
    assert describe_datasets(train, val)["mask_classes"] == len(PHANTOM_CLASSES)
    with pytest.raises(ConfigError, match=r"model.classes = 3, but phantom masks have 1 class "
                                          r"\(lung fields\) or 4"):
        build_datasets(DataConfig(train_images=2, val_images=1), 64, task="segment", classes=3)


def test_segmentation_items_use_their_own_disk_cache(tmp_path):
    cfg = DataConfig(train_images=1, val_images=1, cache_dir=str(tmp_path))
    enhance, _ = build_datasets(cfg, 64)
    segment, _ = build_datasets(cfg, 64, task="segment", classes=1)
    target, mask = enhance[0][1], segment[0][1]
    assert len(list(tmp_path.glob("*.npy"))) == 2  # one per task: neither reads the other's
    again, _ = build_datasets(cfg, 64, task="segment", classes=1)
    assert torch.equal(again[0][1], mask) and target.dtype == torch.float32


# ---------------------------------------------------------------- image / mask folders
def _write(path, pixels):
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), pixels)


def _mask_folder(root, n: int, classes: int, shape=(40, 56)):
    """images/img_XX.png (16 bit) and masks/img_XX.png (binary as 0 / 255) or .tif."""
    rng = np.random.default_rng(0)
    for i in range(n):
        _write(root / "images" / f"img_{i:02d}.png",
               rng.integers(0, 65535, shape, dtype=np.uint16))
        if classes == 1:
            _write(root / "masks" / f"img_{i:02d}.png",
                   (rng.integers(0, 2, shape) * 255).astype(np.uint8))
        else:
            _write(root / "masks" / f"img_{i:02d}.tif",
                   rng.integers(0, classes, shape).astype(np.uint16))
    return root


@pytest.mark.parametrize("classes", [1, 3])
def test_folder_images_with_masks(tmp_path, classes):
    root = _mask_folder(tmp_path / "data", 3, classes)
    train, val = build_datasets(DataConfig("folder", str(root), 2, 1), "native",
                                task="segment", classes=classes)
    x, y = train[0]
    want = load_mask(train.sources[0].pair.target, classes)
    assert y.dtype == torch.uint8 and np.array_equal(y[0].numpy(), want)
    assert x.shape == y.shape == (1, 40, 56)
    assert set(np.unique(want)) == set(range(max(classes, 2)))  # 255 read as 1 when binary


@pytest.mark.parametrize("resize", ["stretch", "cover"])
def test_masks_are_resized_to_the_nearest_class_never_blended(tmp_path, resize):
    """Classes 0 and 2 only: a blend of them would make class 1."""
    root = _mask_folder(tmp_path / "data", 2, 3)
    for path in (root / "masks").iterdir():
        _write(path, (cv2.imread(str(path), cv2.IMREAD_UNCHANGED) > 0).astype(np.uint16) * 2)
    train, _ = build_datasets(DataConfig("folder", str(root), 1, 1, resize=resize), 33,
                              task="segment", classes=3)
    mask = train[0][1]
    assert mask.shape == (1, 33, 33) and set(mask.unique().tolist()) == {0, 2}


def test_every_mask_problem_is_listed_by_file_in_one_error(tmp_path):
    """A missing, a misnamed, a mis-sized and a mask with a class out of range: one error."""
    root = _mask_folder(tmp_path / "data", 6, 3)
    (root / "masks" / "img_01.tif").unlink()  # missing
    (root / "masks" / "img_02.tif").rename(root / "masks" / "img-02.tif")  # misnamed
    _write(root / "masks" / "img_03.tif", np.zeros((40, 50), np.uint16))  # mis-sized
    _write(root / "masks" / "img_04.tif", np.full((40, 56), 7, np.uint16))  # class 7 of 3
    cfg = DataConfig("folder", str(root), 1, 1)
    with pytest.raises(ImageError) as info:
        build_datasets(cfg, "native", task="segment", classes=3)
    text = str(info.value)
    assert text.startswith("5 problems with the images and masks of data.path:")
    for expected in (r"img_01.png: no mask with stem 'img_01'",
                     r"img_02.png: no mask with stem 'img_02'",
                     r"img-02.tif: mask without an image of stem 'img-02' .* \(misnamed\? the "
                     r"image 'img_02' has no mask\)",
                     r"img_03.tif: mask is 40x50 px \(height x width\) but its input img_03.png "
                     r"is 40x56 px",
                     r"img_04.tif: mask holds class indices 7, but model.classes = 3"):
        assert len([line for line in text.splitlines() if re.search(expected, line)]) == 1, \
            expected


def test_mask_folder_layout_and_mask_files_refused_in_one_line(tmp_path):
    root = tmp_path / "data"
    _write(root / "images" / "a.png", np.arange(12, dtype=np.uint8).reshape(3, 4))
    with pytest.raises(ImageError, match=r"needs images/ and masks/ subfolders .*masks/ not found"):
        build_datasets(DataConfig("folder", str(root), 1, 1), "native", task="segment")
    _write(tmp_path / "grey.png", np.full((3, 4), 128, np.uint8))
    with pytest.raises(ImageError, match=r"grey.png: a binary mask \(model.classes = 1\) holds 0 "
                                         r"and 1 \(or 0 and 255\), found 128"):
        load_mask(tmp_path / "grey.png", 1)
    _write(tmp_path / "colour.png", np.dstack([np.zeros((3, 4), np.uint8),
                                                np.ones((3, 4), np.uint8), np.zeros((3, 4), np.uint8)]))
    with pytest.raises(ImageError, match="3 different colour channels; save one grey channel"):
        load_mask(tmp_path / "colour.png", 2)
    (tmp_path / "m.dcm").write_bytes(b"x")
    with pytest.raises(ImageError, match=r"m.dcm: masks must be PNG or TIFF"):
        load_mask(tmp_path / "m.dcm", 2)


def test_segment_classes_are_checked_against_masks_and_phantoms_before_torch():
    """RunConfig.check (no torch): phantoms have 1 or 4 classes; masks at most 255."""
    from memstudy.config import RunConfig

    cfg = RunConfig()
    cfg.train.task, cfg.model.classes = "segment", 4
    cfg.check()
    cfg.model.classes = 2
    with pytest.raises(ConfigError, match=r"^model.classes = 2, but phantom masks have 1 class"):
        cfg.check()
    cfg.model.classes = 300
    with pytest.raises(ConfigError, match=r"^model.classes = 300: masks hold 8-bit class indices"):
        cfg.check()
