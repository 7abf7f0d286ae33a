"""Data: phantoms (determinism, structure, speed), enhancement, folder / DICOM loading, splits."""
from __future__ import annotations

import time

import cv2
import numpy as np
import pytest
import torch

from memstudy.datasets import (
    DataConfig,
    EnhanceParams,
    ImageError,
    RadiographDataset,
    build_datasets,
    enhance_contrast,
    list_images,
    list_pairs,
    load_image,
    make_phantom,
    phantom_layers,
    resize_square,
)
from memstudy.datasets import dataset as dataset_module
from memstudy.datasets import describe_datasets, resize_to
from memstudy.datasets.folder import MONOCHROME1_NOTE, RGB_NOTE
from memstudy.errors import ConfigError


def _dilate(mask: np.ndarray, px: int) -> np.ndarray:
    return cv2.dilate(mask.astype(np.uint8), np.ones((2 * px + 1, 2 * px + 1), np.uint8)) > 0


def _bandpass(image: np.ndarray) -> np.ndarray:
    return cv2.GaussianBlur(image, (0, 0), 1) - cv2.GaussianBlur(image, (0, 0), 4)


def _regions(size: int, seed: int, index: int):
    """Body, air, bone, and soft tissue (body away from bone) masks from the noise-free layers."""
    layers = phantom_layers(size, seed, index)
    body = layers.soft > 0.3 * layers.torso_peak
    air = (layers.soft < 1e-3) & (layers.bone == 0)
    bone = (layers.bone > 0.3) & body
    soft = body & ~_dilate(layers.bone > 0.01, 2)
    return body, air, bone, soft, layers


# ---------------------------------------------------------------- phantoms
def test_phantom_is_deterministic_uint16_square():
    a, b = make_phantom(96, seed=3, index=2), make_phantom(96, seed=3, index=2)
    assert a.dtype == np.uint16 and a.shape == (96, 96)
    np.testing.assert_array_equal(a, b)
    assert int(a.max()) - int(a.min()) > 20000  # uses the 16-bit range


def test_phantom_differs_across_seed_and_index():
    base = make_phantom(96, 0, 0).astype(np.int32)
    for other in (make_phantom(96, 1, 0), make_phantom(96, 0, 1)):
        assert np.abs(base - other).mean() > 300


@pytest.mark.parametrize("size", [31, 0, 64.0, True, "64"])
def test_phantom_rejects_bad_size(size):
    with pytest.raises(ValueError, match="size"):
        make_phantom(size, 0)


def test_phantom_rejects_negative_seed():
    with pytest.raises(ValueError, match="seed"):
        make_phantom(64, -1)


@pytest.mark.parametrize("seed,index", [(0, 0), (1, 5), (7, 3)])
def test_phantom_structure_bone_bright_air_dark(seed, index):
    body, air, bone, soft, _ = _regions(256, seed, index)
    image = make_phantom(256, seed, index).astype(np.float32)
    assert body.mean() > 0.2 and bone.mean() > 0.03 and air.mean() > 0.1
    # convention: higher value = more attenuation (bone bright, air dark)
    assert image[body].mean() > image[air].mean() + 10000
    near_bone = _dilate(bone, 3) & ~_dilate(bone, 1) & soft
    assert image[bone].mean() > image[near_bone].mean() + 3000


def test_phantom_soft_tissue_contrast_is_low():
    *_, soft, _ = _regions(256, 0, 0)
    unit = make_phantom(256, 0, 0).astype(np.float32) / 65535
    assert _bandpass(unit)[soft].std() < 0.02  # local soft-tissue detail: ~1 % of full scale


def test_phantom_is_resolution_independent():
    small = make_phantom(128, 4, 1).astype(np.float32)
    large = cv2.resize(make_phantom(512, 4, 1).astype(np.float32), (128, 128),
                       interpolation=cv2.INTER_AREA)
    assert np.corrcoef(small.ravel(), large.ravel())[0, 1] > 0.98


def test_phantom_generation_speed_2048():
    start = time.perf_counter()
    make_phantom(2048, 0, 0)
    assert time.perf_counter() - start < 4.0  # measured ~0.3 s: see docs/data.md


# ---------------------------------------------------------------- enhancement
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.float32, np.float64])
def test_enhance_accepts_dtypes_and_returns_unit_float(dtype):
    raw = make_phantom(64, 0, 0)
    image = {np.uint8: (raw >> 8).astype(np.uint8), np.uint16: raw}.get(dtype)
    image = raw.astype(dtype) / 65535 if image is None else image
    out = enhance_contrast(image)
    assert out.dtype == np.float32 and out.shape == (64, 64)
    assert out.min() >= 0 and out.max() <= 1 and out.max() - out.min() > 0.9


def test_enhance_rejects_bad_input():
    for bad in (np.zeros((4, 4, 3), np.uint8), np.zeros((0, 5), np.uint16),
                np.full((8, 8), 1.5, np.float32), np.zeros((8, 8), np.int32)):
        with pytest.raises(ValueError):
            enhance_contrast(bad)
    with pytest.raises(ValueError, match="tiles"):
        EnhanceParams(tiles=0)


def test_enhance_raises_local_soft_tissue_contrast():
    *_, soft, _ = _regions(256, 0, 0)
    raw = make_phantom(256, 0, 0)
    before = _bandpass(raw.astype(np.float32) / 65535)[soft].std()
    after = _bandpass(enhance_contrast(raw))[soft].std()
    assert after > 2 * before


def test_enhance_is_resolution_independent():
    small = enhance_contrast(make_phantom(128, 2, 0))
    large = cv2.resize(enhance_contrast(make_phantom(512, 2, 0)), (128, 128),
                       interpolation=cv2.INTER_AREA)
    assert np.corrcoef(small.ravel(), large.ravel())[0, 1] > 0.95


# ---------------------------------------------------------------- folder loading
def _write_dicom(path, pixels: np.ndarray, photometric="MONOCHROME2", slope=1.0, intercept=0.0,
                 bits=12, syntax=None, pixel_data=None):
    from pydicom import dcmwrite
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = syntax or ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID = meta.MediaStorageSOPClassUID
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    ds.Modality = "DX"
    ds.Rows, ds.Columns = pixels.shape[:2]
    colour = pixels.ndim == 3
    ds.SamplesPerPixel, ds.PhotometricInterpretation = (3 if colour else 1), photometric
    if colour:
        ds.PlanarConfiguration = 0
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, bits, bits - 1, 0
    ds.RescaleSlope, ds.RescaleIntercept = slope, intercept
    ds.PixelData = pixel_data if pixel_data is not None else pixels.astype(np.uint16).tobytes()
    dcmwrite(path, ds, enforce_file_format=True)


def _ramp(dtype, top: int, shape=(20, 30)) -> np.ndarray:
    return np.linspace(0, top, shape[0] * shape[1]).reshape(shape).round().astype(dtype)


def test_load_png_tiff_8_and_16_bit(tmp_path):
    cases = {"a8.png": _ramp(np.uint8, 255), "a16.png": _ramp(np.uint16, 65535),
             "a16.tif": _ramp(np.uint16, 40000),
             "colour.png": np.dstack([_ramp(np.uint8, 255)] * 3)}
    for name, pixels in cases.items():
        assert cv2.imwrite(str(tmp_path / name), pixels)
        image = load_image(tmp_path / name)
        assert image.dtype == np.float32 and image.shape == (20, 30)
        top = 255 if pixels.dtype == np.uint8 else 65535
        np.testing.assert_allclose(image, pixels.reshape(20, 30, -1)[..., 0] / top, atol=2e-3)


def test_load_dicom_rescale_and_monochrome1(tmp_path):
    pixels = _ramp(np.uint16, 4095)
    _write_dicom(tmp_path / "m2.dcm", pixels, slope=2.0, intercept=-100.0)
    _write_dicom(tmp_path / "m1_no_suffix", pixels, photometric="MONOCHROME1")
    normal = load_image(tmp_path / "m2.dcm")
    inverted = load_image(tmp_path / "m1_no_suffix")  # found by its DICM marker
    np.testing.assert_allclose(normal, pixels / 4095, atol=1e-5)  # min-max after rescale
    np.testing.assert_allclose(inverted, 1 - pixels / 4095, atol=1e-5)
    assert [p.name for p in list_images(tmp_path)] == ["m1_no_suffix", "m2.dcm"]


def test_corrupt_empty_and_unsupported_files_raise_naming_the_file(tmp_path):
    corrupt = tmp_path / "scan_03.png"
    corrupt.write_bytes(np.random.default_rng(0).bytes(500))
    truncated = tmp_path / "cut.png"
    cv2.imwrite(str(truncated), _ramp(np.uint16, 65535, (64, 64)))
    truncated.write_bytes(truncated.read_bytes()[:60])
    (tmp_path / "empty.tif").write_bytes(b"")
    (tmp_path / "bad.dcm").write_bytes(b"not a dicom file at all")
    for name, reason in [("scan_03.png", "cannot decode"), ("cut.png", "cannot decode"),
                         ("empty.tif", "empty file"), ("bad.dcm", "")]:
        with pytest.raises(ImageError, match=name) as info:
            load_image(tmp_path / name)
        assert reason in str(info.value)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ImageError, match=r"notes\.txt: unsupported file type '\.txt'"):
        load_image(tmp_path / "notes.txt")


def test_list_images_missing_and_empty_folders(tmp_path):
    with pytest.raises(ImageError, match="not found"):
        list_images(tmp_path / "nope")
    (tmp_path / "readme.txt").write_text("x")
    with pytest.raises(ImageError, match="no images found"):
        list_images(tmp_path)


def _folder(root, n: int, paired: bool = False):
    rng = np.random.default_rng(0)
    inputs = root / "inputs" if paired else root
    inputs.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        pixels = rng.integers(0, 65535, (40, 56), dtype=np.uint16)
        cv2.imwrite(str(inputs / f"img_{i:02d}.png"), pixels)
        if paired:
            (root / "targets").mkdir(exist_ok=True)
            cv2.imwrite(str(root / "targets" / f"img_{i:02d}.tif"), pixels[::-1].copy())
    return root


def test_paired_layout_and_missing_partner(tmp_path):
    root = _folder(tmp_path / "data", 3, paired=True)
    pairs = list_pairs(root)
    assert [(p.input.name, p.target.name) for p in pairs] == \
        [(f"img_{i:02d}.png", f"img_{i:02d}.tif") for i in range(3)]
    (root / "targets" / "img_01.tif").unlink()
    with pytest.raises(ImageError, match="img_01.png: no target"):
        list_pairs(root)


def test_folder_items_resized_and_targets(tmp_path):
    root = _folder(tmp_path / "paired", 3, paired=True)
    train, val = build_datasets(DataConfig("folder", str(root), 2, 1, seed=0, resize="stretch"), 32)
    x, y = train[0]
    source = load_image(train.sources[0].pair.target)
    np.testing.assert_allclose(y[0].numpy(), resize_square(source, 32), atol=1e-4)
    plain = _folder(tmp_path / "plain", 3)
    generated, _ = build_datasets(DataConfig("folder", str(plain), 2, 1, resize="stretch"), 32)
    expected = resize_square(enhance_contrast(load_image(generated.sources[0].pair.input)), 32)
    np.testing.assert_allclose(generated[0][1][0].numpy(), expected, atol=1e-4)
    assert x.shape == y.shape == (1, 32, 32)


def test_folder_split_is_seeded_and_disjoint(tmp_path):
    root = _folder(tmp_path, 8)
    cfg = DataConfig("folder", str(root), train_images=5, val_images=3, seed=1, resize="stretch")
    train, val = build_datasets(cfg, 32)
    again, _ = build_datasets(cfg, 32)
    assert train.names == again.names and len(train) == 5 and len(val) == 3
    assert sorted(train.names + val.names) == [f"img_{i:02d}" for i in range(8)]
    other = {tuple(build_datasets(DataConfig("folder", str(root), 5, 3, seed=s, resize="stretch"), 32)[0].names)
             for s in range(2, 6)}
    assert len(other | {tuple(train.names)}) > 1


def test_too_few_images_and_corrupt_member_fail_at_build(tmp_path):
    root = _folder(tmp_path, 4)
    with pytest.raises(ValueError, match=r"4 images.*data\.train_images.*data\.val_images"):
        build_datasets(DataConfig("folder", str(root), train_images=3, val_images=2), 32)
    (root / "img_02.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(ImageError, match="img_02.png"):
        build_datasets(DataConfig("folder", str(root), train_images=3, val_images=1, resize="stretch"), 32)


# ---------------------------------------------------------------- config and datasets
@pytest.mark.parametrize("cfg,field", [
    (DataConfig(source="folder"), "data.path is required"),
    (DataConfig(source="web"), "data.source"),
    (DataConfig(path="/x"), "data.path is set"),
    (DataConfig(train_images=0), "data.train_images"),
    (DataConfig(val_images=1.5), "data.val_images"),
    (DataConfig(seed=-2), "data.seed"),
])
def test_data_config_validate_names_the_field(cfg, field):
    with pytest.raises(ValueError, match=field):
        cfg.validate()


def test_synthetic_datasets_distinct_items_in_unit_range():
    train, val = build_datasets(DataConfig(train_images=3, val_images=2, seed=5), 64)
    assert isinstance(train, RadiographDataset) and (len(train), len(val)) == (3, 2)
    assert not set(train.names) & set(val.names)
    x, y = train[-1]
    assert x.shape == y.shape == (1, 64, 64) and x.dtype == y.dtype == torch.float32
    assert 0 <= x.min() and x.max() <= 1 and 0 <= y.min() and y.max() <= 1
    np.testing.assert_allclose(x[0].numpy(), make_phantom(64, 5, 2) / 65535, atol=1e-6)
    assert not torch.equal(train[0][0], val[0][0])
    with pytest.raises(IndexError):
        train[3]


def test_disk_cache_is_reused(tmp_path, monkeypatch):
    cfg = DataConfig(train_images=2, val_images=1, cache_dir=str(tmp_path / "cache"))
    first = build_datasets(cfg, 64)[0][1]
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1

    def fail(*args, **kwargs):
        raise AssertionError("regenerated despite the cache")

    monkeypatch.setattr(dataset_module, "make_phantom", fail)
    second = build_datasets(cfg, 64)[0][1]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ---------------------------------------------------------------- native-size real data
def test_dicom_16_bit_rectangular_monochrome_and_rgb(tmp_path):
    """16-bit DICOMs keep their own (rectangular) shape; MONOCHROME1 is inverted and RGB made
    grey, and both conversions are reported."""
    pixels = _ramp(np.uint16, 65535, (24, 40))
    _write_dicom(tmp_path / "m2.dcm", pixels, bits=16)
    _write_dicom(tmp_path / "m1.dcm", pixels, photometric="MONOCHROME1", bits=16)
    rgb = np.dstack([pixels, pixels // 2, pixels // 4])
    _write_dicom(tmp_path / "rgb.dcm", rgb, photometric="RGB", bits=16)
    notes = {}
    for name in ("m2", "m1", "rgb"):
        notes[name] = []
        image = load_image(tmp_path / f"{name}.dcm", notes[name])
        assert image.shape == (24, 40) and image.dtype == np.float32
        expected = {"m2": pixels / 65535, "m1": 1 - pixels / 65535,
                    "rgb": pixels / 65535}[name]  # grey of (p, p/2, p/4) is linear in p
        np.testing.assert_allclose(image, expected, atol=1e-4)
    assert notes["m2"] == [] and notes["m1"] == [MONOCHROME1_NOTE] and notes["rgb"] == [RGB_NOTE]


def test_tiff_16_bit_rectangular_keeps_its_shape(tmp_path):
    pixels = _ramp(np.uint16, 65535, (30, 52))
    assert cv2.imwrite(str(tmp_path / "r.tiff"), pixels)
    image = load_image(tmp_path / "r.tiff")
    assert image.shape == (30, 52)
    np.testing.assert_allclose(image, pixels / 65535, atol=1e-6)


def _missing_decoder_syntax():
    from pydicom.pixels import get_decoder
    from pydicom.uid import JPEGLosslessSV1, JPEGLSLossless, RLELossless

    for uid in (JPEGLosslessSV1, JPEGLSLossless, RLELossless):
        if not get_decoder(uid).is_available:
            return uid
    pytest.skip("every compressed transfer syntax tried has a decoder installed here")


def test_dicom_without_decoder_names_file_and_package(tmp_path):
    from pydicom.encaps import encapsulate

    syntax = _missing_decoder_syntax()
    frame = b"\xff\xd8" + bytes(62)  # never decoded: the missing decoder is found first
    path = tmp_path / "compressed.dcm"
    _write_dicom(path, np.zeros((16, 16), np.uint16), bits=16, syntax=syntax,
                 pixel_data=encapsulate([frame]))
    with pytest.raises(ImageError) as info:
        load_image(path)
    message = str(info.value)
    assert "compressed.dcm" in message and syntax.name in message
    assert "pylibjpeg" in message and "install" in message


def test_folder_error_lists_every_unreadable_file(tmp_path):
    root = _folder(tmp_path, 5)
    (root / "img_01.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    (root / "img_03.png").write_bytes(b"")
    (root / "img_04.png").write_bytes(np.random.default_rng(1).bytes(300))
    with pytest.raises(ImageError) as info:
        build_datasets(DataConfig("folder", str(root), train_images=3, val_images=2), "native")
    message = str(info.value)
    assert "3 of 5 images cannot be used" in message
    for name in ("img_01.png", "img_03.png", "img_04.png"):
        assert name in message
    assert "img_00.png" not in message and "img_02.png" not in message


@pytest.mark.parametrize("shape", [(1, 1), (4, 300)])
def test_a_tiny_image_is_refused_for_its_size(tmp_path, shape):
    """A 1 x 1 image is constant too: its size is what to tell the user."""
    path = tmp_path / "tiny.png"
    cv2.imwrite(str(path), np.full(shape, 7, np.uint8))
    with pytest.raises(ImageError, match=rf"tiny.png: image is {shape[0]} x {shape[1]} px, too "
                                         "small to hold a radiograph"):
        load_image(path)


def test_cover_keeps_aspect_ratio_and_stretch_does_not():
    image = np.tile(np.linspace(0, 1, 200, dtype=np.float32), (100, 1))  # 100 x 200 ramp
    covered = resize_to(image, (50, 50), "cover")  # scale 0.5 -> 50 x 100, centre 50 columns
    np.testing.assert_allclose(covered, cv2.resize(image, (100, 50),
                                                   interpolation=cv2.INTER_AREA)[:, 25:75])
    stretched = resize_to(image, (50, 50), "stretch")
    np.testing.assert_allclose(stretched, resize_square(image, 50))
    assert covered.shape == stretched.shape == (50, 50)
    assert covered[0, -1] - covered[0, 0] < 0.6 < stretched[0, -1] - stretched[0, 0]


def test_rectangular_phantom_is_the_centre_of_the_square_one():
    wide, tall = make_phantom((64, 96), 2, 1), make_phantom((96, 40), 2, 1)
    square = make_phantom(96, 2, 1)
    assert wide.shape == (64, 96) and tall.shape == (96, 40)
    np.testing.assert_array_equal(wide, square[16:80])
    np.testing.assert_array_equal(tall, square[:, 28:68])
    train, _ = build_datasets(DataConfig(train_images=1, val_images=1), (64, 96))
    assert train[0][0].shape == (1, 64, 96)


def test_folder_size_mismatch_needs_a_resize_mode(tmp_path):
    root = _folder(tmp_path, 3)  # 40 x 56 images
    with pytest.raises(ConfigError, match=r"img_00 \(40x56\).*data\.resize = 'stretch'"):
        build_datasets(DataConfig("folder", str(root), 2, 1), 40)
    train, _ = build_datasets(DataConfig("folder", str(root), 2, 1), (40, 56))  # exact: fine
    assert train[0][0].shape == (1, 40, 56)
    covered, _ = build_datasets(DataConfig("folder", str(root), 2, 1, resize="cover"), 40)
    assert covered[0][0].shape == (1, 40, 40)
    assert describe_datasets(*build_datasets(DataConfig("folder", str(root), 2, 1,
                                                        resize="stretch"), 32))["train_resampled"] == 2
