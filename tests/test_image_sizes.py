"""Image sizes: any side, rectangles and native folder images; padding to the network's stride
is reflected and cropped, and every figure counts the image's own pixels."""
from __future__ import annotations

import sqlite3

import cv2
import numpy as np
import pytest
import torch

from memstudy.cli import build_parser, config_from_args
from memstudy.config import RunConfig, from_dict, set_value
from memstudy.errors import ConfigError
from memstudy.grid import spec_from_dict
from memstudy.maxres import search, size_grid
from memstudy.models import build_unet
from memstudy.runner import execute
from memstudy.image_sizes import parse_size, size_hw
from memstudy.store import ResultsDB


# ---------------------------------------------------------------- parsing and config forms
@pytest.mark.parametrize("given, canonical", [
    (4188, 4188), ("4188", 4188), ("4188x4188", 4188), ("4188x3500", "4188x3500"),
    (" 200 X 296 ", "200x296"), ("native", "native"), ("NATIVE", "native"),
])
def test_size_forms_parse_to_one_canonical_form(given, canonical):
    assert parse_size(given) == canonical


@pytest.mark.parametrize("bad", ["12x", "axb", "0x300", "300x0", "", "4188x3500x2", "-5", 0,
                                 True, 3.5, [256]])
def test_malformed_sizes_are_refused_naming_the_setting(bad):
    with pytest.raises(ConfigError, match="train.image_size"):
        parse_size(bad)


def test_toml_set_and_cli_give_the_same_stored_config_and_hash():
    toml = from_dict({"train": {"image_size": "200x296"}})
    toml.check()
    by_set = RunConfig()
    set_value(by_set, "train.image_size=200x296")
    by_set.check()
    cli = config_from_args(build_parser().parse_args(["run", "--size", "200x296"]))
    cli.check()
    assert toml.train.image_size == by_set.train.image_size == cli.train.image_size == "200x296"
    assert toml.hash() == by_set.hash() == cli.hash()
    square = [RunConfig(), RunConfig()]
    square[0].train.image_size, square[1].train.image_size = 4188, "4188x4188"
    for cfg in square:
        cfg.check()
    assert square[0].hash() == square[1].hash() and square[1].train.image_size == 4188
    assert size_hw("4188x3500") == (4188, 3500)


def test_grid_specs_and_maxres_accept_the_same_forms():
    spec = spec_from_dict({"image_sizes": [225, "200x296", "256x256", "native"]})
    assert spec.image_sizes == [225, "200x296", 256, "native"]
    with pytest.raises(ConfigError, match="grid image_sizes"):
        spec_from_dict({"image_sizes": ["12x"]})
    assert size_grid(192, 4188)[-2:] == [4160, 4188]  # the non-multiple end is probed itself
    assert search(lambda s: s <= 4188, 1000, 192, 4188) == 4188
    assert search(lambda s: s <= 1003, 1000, 192, 4188, step=4) == 1000
    assert search(lambda s: s <= 1003, 1000, 192, 1003, step=4) == 1003


# ---------------------------------------------------------------- padding
def test_padding_is_a_reflection_and_is_cropped():
    model = build_unet()
    seen = {}

    def record(x):
        seen["padded"] = x
        return x[:, :1] * 0.5  # same shape as the network's output: shows the crop

    model.forward_padded = record
    x = torch.rand(2, 1, 200, 296)
    out = model(x)
    padded = seen["padded"]
    assert padded.shape == (2, 1, 224, 320) and out.shape == x.shape
    torch.testing.assert_close(padded[..., :200, :296], x, rtol=0, atol=0)
    # reflect about the last real row / column (the edge pixel itself is not repeated)
    torch.testing.assert_close(padded[..., 200:, :296], x.flip(-2)[..., 1:25, :], rtol=0, atol=0)
    torch.testing.assert_close(padded[..., :200, 296:], x.flip(-1)[..., :, 1:25], rtol=0, atol=0)
    torch.testing.assert_close(out, x * 0.5, rtol=0, atol=0)  # the top-left, real region


def test_real_network_output_has_the_input_size():
    model = build_unet().eval()
    with torch.no_grad():
        for shape in ((1, 1, 225, 225), (1, 1, 200, 296)):
            assert model(torch.rand(shape)).shape == shape


def test_local_split_pads_and_crops_as_the_model_does():
    from memstudy.techniques.mp.split import LocalSplitUNet

    model = build_unet().eval()
    x = torch.rand(1, 1, 200, 296)
    with torch.no_grad():
        whole = model(x)
        split = LocalSplitUNet(model, torch.device("cpu"), torch.device("cpu"))(x)
    torch.testing.assert_close(split, whole, rtol=0, atol=0)


@pytest.mark.parametrize("techniques", [["mp"], ["pipeline"]])
def test_process_splits_refuse_sizes_they_cannot_crop(make_config, techniques):
    from memstudy.techniques.compose import make_plan

    cfg = make_config(200, techniques=techniques, batch_size=2)
    cfg.world_size = 2
    with pytest.raises(ConfigError, match="multiples of 32"):
        make_plan(cfg)


# ---------------------------------------------------------------- training at any size
def _shape_spy(monkeypatch):
    """Records the shapes the loss and the validation figures see."""
    from memstudy import quality, train

    seen = []
    loss_forward = quality.MSSSIMLoss.forward

    def spy_loss(self, out, target):
        seen.append(("loss", tuple(out.shape), tuple(target.shape)))
        return loss_forward(self, out, target)

    def spy_quality(out, target, scales):
        seen.append(("validation", tuple(out.shape), tuple(target.shape)))
        return quality.quality(out, target, scales)

    monkeypatch.setattr(quality.MSSSIMLoss, "forward", spy_loss)
    monkeypatch.setattr(train, "quality", spy_quality)
    return seen


@pytest.mark.parametrize("size, hw", [("200x296", (200, 296)), (225, (225, 225))])
def test_non_multiple_sizes_train_on_real_pixels(make_config, monkeypatch, tmp_path, size, hw):
    seen = _shape_spy(monkeypatch)
    db = ResultsDB(tmp_path / "r.sqlite")
    cfg = make_config(size)
    rec = execute(cfg, db)
    assert rec.status == "ok", rec.error
    assert {s[1] for s in seen} == {s[2] for s in seen} == {(1, 1, *hw)}
    assert {s[0] for s in seen} == {"loss", "validation"}
    (run,) = db.runs()
    metrics = db.metrics(run["id"])
    figures = metrics[(0, "run")]
    # the loss's own memory is recorded as a category of the forward (tensor meter, CPU)
    assert metrics[(0, "forward")]["cat_loss_saved_bytes"] > 0
    assert metrics[(0, "forward")]["loss_peak_bytes"] > 0
    real = hw[0] * hw[1]
    padded = (-(-hw[0] // 32) * 32) * (-(-hw[1] // 32) * 32)
    assert figures["real_px_per_step"] == real
    assert figures["padding_ratio"] == pytest.approx(padded / real)
    assert (figures["pad_bottom_px"], figures["pad_right_px"]) == (-hw[0] % 32, -hw[1] % 32)
    assert figures["throughput_px_s"] == pytest.approx(real / figures["step_time_s"])
    from memstudy.meters.flops import model_flops_per_step
    padded_hw = (-(-hw[0] // 32) * 32, -(-hw[1] // 32) * 32)
    assert figures["model_flops_per_step"] == model_flops_per_step(1, padded_hw)  # padded size
    assert rec.config["train"]["image_size"] == parse_size(size)


def _mixed_folder(root, shapes):
    root.mkdir()
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate(shapes):
        smooth = cv2.GaussianBlur(rng.random((h, w)).astype(np.float32), (0, 0), 3)
        cv2.imwrite(str(root / f"xr_{i}.png"), (smooth / smooth.max() * 65535).astype(np.uint16))
    return root


def test_mixed_size_folder_trains_at_native_size(make_config, monkeypatch, tmp_path):
    shapes = [(192, 224), (200, 176), (168, 240)]
    root = _mixed_folder(tmp_path / "xr", shapes)
    seen = _shape_spy(monkeypatch)
    cfg = make_config("native")
    cfg.data.source, cfg.data.path = "folder", str(root)
    rec = execute(cfg, None)
    assert rec.status == "ok", rec.error
    assert {s[1][2:] for s in seen} == set(shapes) and all(s[1] == s[2] for s in seen)
    facts = rec.env["data"]
    assert facts["size"] == "native" and facts["train_resampled"] == 0
    run = {k: v for _, phase, k, v in rec.metrics if phase == "run"}
    train_shapes = [tuple(map(int, k.split("x"))) for k in facts["train_native_shapes"]]
    assert run["real_px_per_step"] == pytest.approx(np.mean([h * w for h, w in train_shapes]))


# ---------------------------------------------------------------- refusals record nothing
def _snapshot(db: ResultsDB):
    con = sqlite3.connect(db.path)
    try:
        return {t: con.execute(f"SELECT * FROM {t}").fetchall() for t in ("runs", "metrics")}
    finally:
        con.close()


@pytest.fixture
def db_with_a_row(tmp_path):
    from memstudy.store import RunRecord

    db = ResultsDB(tmp_path / "r.sqlite")
    db.record(RunRecord(config={"train": {"image_size": 192, "batch_size": 1}}, config_hash="h",
                        name="original", status="ok", env={"device": "cpu"}, started_at=0.0,
                        finished_at=1.0, metrics=[(0, "run", "step_time_s", 1.0)]))
    return db


@pytest.mark.parametrize("size, source, batch, message", [
    ("160x300", "synthetic", 1, r"train.image_size 160x300 is too small.*161 px per side"),
    ("300x150", "synthetic", 1, r"train.image_size 300x150 is too small"),
    ("native", "synthetic", 1, r"train.image_size = 'native' needs folder data.*data.source"),
    ("12x", "synthetic", 1, r"train.image_size = '12x' is not a size"),
    ("axb", "synthetic", 1, r"train.image_size = 'axb' is not a size"),
    ("0x300", "synthetic", 1, r"train.image_size = '0x300'.*>= 1 px"),
    ("native", "mixed", 2, r"train.batch_size = 2.*differ in shape.*train.batch_size = 1"),
    (192, "mixed", 1, r"not train.image_size = 192x192.*data.resize = 'stretch'"),
])
def test_bad_sizes_are_refused_and_record_nothing(make_config, db_with_a_row, tmp_path,
                                                  size, source, batch, message):
    cfg = make_config(size, batch_size=batch)
    if source == "mixed":
        root = _mixed_folder(tmp_path / "xr", [(192, 224), (200, 176), (192, 224)])
        cfg.data.source, cfg.data.path = "folder", str(root)
    before = _snapshot(db_with_a_row)
    with pytest.raises(ConfigError, match=message):
        execute(cfg, db_with_a_row)
    assert _snapshot(db_with_a_row) == before


def test_cli_refuses_a_bad_size_without_traceback(capsys, tmp_path):
    from memstudy.cli import main

    code = main(["--db", str(tmp_path / "r.sqlite"), "run", "--size", "axb", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "train.image_size" in err and "Traceback" not in err
