"""`memstudy run` end to end: training works, every outcome is recorded or refused cleanly."""
import json
import sqlite3

import cv2
import numpy as np
import pytest
import torch

from memstudy.cli import main
from memstudy.errors import ConfigError
from memstudy.runner import execute
from memstudy.runtime import Runtime
from memstudy.store import ResultsDB, RunRecord


def _snapshot(db: ResultsDB):
    con = sqlite3.connect(db.path)
    try:
        return {t: con.execute(f"SELECT * FROM {t} ORDER BY 1, 2, 3").fetchall()
                for t in ("runs", "metrics", "epochs", "series")}
    finally:
        con.close()


@pytest.fixture(scope="module")
def recorded_db(tmp_path_factory):
    from conftest import small_config

    db = ResultsDB(tmp_path_factory.mktemp("db") / "r.sqlite")
    assert execute(small_config(192, validate=False), db).status == "ok"
    return db


@pytest.fixture
def db_with_a_run(recorded_db, tmp_path):
    """A fresh copy of a database holding one recorded run."""
    src = sqlite3.connect(recorded_db.path)
    dst = sqlite3.connect(tmp_path / "r.sqlite")
    src.backup(dst)
    src.close()
    dst.close()
    return ResultsDB(tmp_path / "r.sqlite")


def test_training_on_phantoms_lowers_validation_loss(make_config):
    cfg = make_config(192, epochs=4, lr=3e-3, measure_steps=1)
    cfg.data.train_images, cfg.data.val_images = 4, 2
    cfg.meter.tensor = "off"
    rec = execute(cfg, db=None)
    assert rec.status == "ok", rec.error
    val = [e["val_loss"] for e in rec.epochs]
    # eval-mode BatchNorm needs a few steps of running statistics before validation follows
    assert val[-1] < val[0] - 0.1, val
    assert rec.epochs[-1]["train_loss"] < rec.epochs[0]["train_loss"]
    assert all(np.isfinite(v) for v in val)


def test_out_of_memory_is_recorded_with_its_phase(db_with_a_run, make_config, monkeypatch):
    before = _snapshot(db_with_a_run)

    def oom(self, loss):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    monkeypatch.setattr(Runtime, "backward", oom)
    rec = execute(make_config(192), db_with_a_run)
    assert (rec.status, rec.failed_phase) == ("oom", "backward")
    after = _snapshot(db_with_a_run)
    runs = db_with_a_run.runs()
    assert [r["status"] for r in runs] == ["ok", "oom"]
    assert "injected" in runs[-1]["error"]
    for table, rows in before.items():  # nothing already recorded is lost or changed
        assert set(rows) <= set(after[table])


def test_nan_loss_is_recorded_as_diverged(db_with_a_run, make_config, monkeypatch):
    monkeypatch.setattr(Runtime, "forward", lambda self, m, x, y: m(x).sum() * float("nan"))
    rec = execute(make_config(192), db_with_a_run)
    assert (rec.status, rec.failed_phase) == ("diverged", "forward")
    assert "train.lr" in rec.error
    assert [r["status"] for r in db_with_a_run.runs()] == ["ok", "diverged"]


@pytest.mark.parametrize("change, message", [
    (dict(image_size="200x"), "is not a size"),
    (dict(image_size=128), "minimum is 161"),
    (dict(device="cuda"), "train.device"),
    (dict(batch_size=0), "train.batch_size"),
    (dict(optimizer="lion"), "train.optimizer"),
    (dict(warmup_steps=2), r"takes 2 optimizer step\(s\) .* leaves none to measure"),
])
def test_bad_config_is_refused_and_records_nothing(db_with_a_run, make_config, change, message):
    if change.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    before = _snapshot(db_with_a_run)
    cfg = make_config(**{"size": change.pop("image_size", 192)}, **change)
    with pytest.raises(ConfigError, match=message):
        execute(cfg, db_with_a_run)
    assert _snapshot(db_with_a_run) == before


def test_unknown_technique_lists_the_valid_names(make_config):
    with pytest.raises(ConfigError, match="unknown technique 'teleport'; valid"):
        execute(make_config(192, techniques=["teleport"]), db=None)


def test_bad_image_path_is_refused_and_records_nothing(db_with_a_run, make_config, tmp_path):
    before = _snapshot(db_with_a_run)
    cfg = make_config(192)
    cfg.data.source, cfg.data.path = "folder", str(tmp_path / "no-such-folder")
    with pytest.raises(ValueError, match="no-such-folder"):
        execute(cfg, db_with_a_run)
    bad = tmp_path / "bad"
    bad.mkdir()
    for i in (2, 3):
        cv2.imwrite(str(bad / f"scan_0{i}.png"), np.full((64, 64), 40 * i, np.uint8))
    (bad / "scan_01.png").write_bytes(b"\x89PNG not really")
    cfg.data.path = str(bad)
    with pytest.raises(ValueError, match="scan_01.png"):
        execute(cfg, db_with_a_run)
    assert _snapshot(db_with_a_run) == before


def test_a_failed_write_leaves_no_half_written_run(db_with_a_run):
    run = db_with_a_run.runs()[0]
    rec = RunRecord(config=json.loads(run["config_json"]), config_hash="x", name="original",
                    status="ok", env={"device": "cpu"}, started_at=0.0,
                    metrics=[(0, "forward", "time_s", 1.0)] * 2)  # duplicate key: fails midway
    before = _snapshot(db_with_a_run)
    with pytest.raises(sqlite3.IntegrityError):
        db_with_a_run.record(rec)
    assert _snapshot(db_with_a_run) == before


def test_cli_run_prints_the_phase_table_and_stores_the_run(tmp_path, capsys):
    db = tmp_path / "cli.sqlite"
    code = main(["--db", str(db), "run", "--size", "192", "--device", "cpu", "-q",
                 "--set", "data.train_images=2", "--set", "data.val_images=1",
                 "--set", "train.measure_steps=1", "--set", "train.warmup_steps=1"])
    out = capsys.readouterr().out
    assert code == 0, out
    for word in ("forward", "backward", "step", "peak MB", "time per step", "stored in"):
        assert word in out
    assert len(ResultsDB(db).runs()) == 1


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    code = main(["--db", str(tmp_path / "x.sqlite"), "run", "--size", "96", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "train.image_size" in err and "Traceback" not in err
    code = main(["--db", str(tmp_path / "x.sqlite"), "run", "--set", "train.nope=1"])
    assert code == 2 and "no such setting" in capsys.readouterr().err


class _Float16Overflow(torch.nn.Module):
    """Finite in float32; in float16 its 1e5-scaled branch overflows to inf and inf - inf = NaN,
    as an eval-mode forward with unsettled BatchNorm statistics does at large images."""

    def __init__(self, finite_in_float32: bool = True):
        super().__init__()
        self.scale = torch.nn.Conv2d(1, 1, 1, bias=False)
        torch.nn.init.constant_(self.scale.weight, 1e5 if finite_in_float32 else float("inf"))

    def forward(self, x):
        h = self.scale(x)
        return torch.sigmoid(h - h + x)


@pytest.mark.parametrize("finite_in_float32", [True, False])
@pytest.mark.parametrize("float16_by", ["amp note", "loss scaler"])  # amp:fp16 / tri_accel
def test_validation_overflow_in_float16_is_told_apart_from_diverged_weights(make_config,
                                                                            finite_in_float32,
                                                                            float16_by):
    import functools

    from memstudy.datasets import build_datasets
    from memstudy.errors import Diverged
    from memstudy.meters import PhaseRecorder
    from memstudy.techniques.compose import build_pipeline, make_plan
    from memstudy.train import validate

    cfg = make_config(192, techniques=["amp:bf16"])
    build = build_pipeline(make_plan(cfg))
    # what amp:fp16 sets up on a GPU, here on the CPU (whose autocast also runs float16)
    build.model = _Float16Overflow(finite_in_float32)
    build.runtime.forward_contexts = [functools.partial(torch.autocast, "cpu", dtype=torch.float16)]
    if float16_by == "amp note":
        build.notes["autocast_dtype"] = str(torch.float16)
    else:  # tri_accel's FP16 units set no autocast note but bring a loss scaler
        build.runtime.scaler = torch.amp.GradScaler("cpu")
    _, val_set = build_datasets(cfg.data, 192)
    recorder = PhaseRecorder(build.device, build.model, build.runtime, lambda: None, cfg.meter)
    with pytest.raises(Diverged) as err:
        validate(build, val_set, recorder, step=7)
    recorder.close()
    assert err.value.phase == "validation" and err.value.step == 7
    if finite_in_float32:
        assert "in float32, so the float16 eval forward overflowed" in str(err.value)
    else:  # NaN in float32 too: the weights themselves are bad
        assert "lower train.lr" in str(err.value)
    assert build.model.training  # validation always hands the model back in train mode


@pytest.mark.parametrize("techniques, images, batch, epochs, max_steps, steps", [
    ([], 5, 2, 1, None, 3),            # one process keeps the incomplete last batch
    (["dp"], 5, 2, 1, None, 2),        # data-parallel ranks drop it (every rank must step)
    (["fsdp"], 5, 2, 3, None, 6),
    (["mp:mode=process"], 5, 2, 2, None, 6),
    ([], 16, 2, 3, 10, 10),            # max_steps caps all epochs together
])
def test_planned_steps_follow_the_loop(make_config, techniques, images, batch, epochs, max_steps,
                                       steps):
    from memstudy.techniques import planned_steps

    cfg = make_config(192, techniques=techniques, batch_size=batch, epochs=epochs,
                      max_steps=max_steps)
    assert planned_steps(cfg, images) == steps


def test_validation_images_are_drawn_before_the_metered_phase(make_config, monkeypatch):
    """The validation phase times the model's work, not the drawing of its phantoms (a 16384 px
    one takes tens of seconds of CPU): every image is drawn when the phase starts."""
    from memstudy.datasets import build_datasets
    from memstudy.meters import PhaseRecorder
    from memstudy.techniques.compose import build_pipeline, make_plan
    from memstudy.train import validate

    cfg = make_config(192)
    cfg.data.val_images = 2
    build = build_pipeline(make_plan(cfg))
    _, val_set = build_datasets(cfg.data, 192)
    recorder = PhaseRecorder(build.device, build.model, build.runtime, lambda: None, cfg.meter)
    started, phase = [], recorder.phase
    monkeypatch.setattr(recorder, "phase", lambda name, *a, **k: started.append(
        (name, len(val_set._memo))) or phase(name, *a, **k))
    try:
        validate(build, val_set, recorder)
    finally:
        recorder.close()
    assert started == [("validation", 2)]
