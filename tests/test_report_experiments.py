"""Report rows are experiments: runs that differ in any measured setting are never averaged
into one row (memstudy.report.experiments); only the seed is."""
from __future__ import annotations

import copy
import json

import pytest

from memstudy import advise, report
from memstudy.report.experiments import settings
from memstudy.store import ResultsDB, RunRecord

MB = 1024**2
SIZE = 64
BASE = {"train": {"image_size": SIZE, "batch_size": 1, "epochs": 1, "lr": 1e-3},
        "data": {"source": "synthetic", "path": None, "train_images": 6, "val_images": 2,
                 "resize": "none"},
        "techniques": [], "world_size": 1}
# one experiment each, every one "original 64 px" to a table grouped by set and size only
VARIANTS = {
    "folder a": {"data": {"source": "folder", "path": "/data/a"}},
    "folder b": {"data": {"source": "folder", "path": "/data/b"}},
    "folder b resized": {"data": {"source": "folder", "path": "/data/b", "resize": "stretch"}},
    "more images": {"data": {"train_images": 48}},
    "lr": {"train": {"lr": 1e-2}},
    "epochs": {"train": {"epochs": 3}},
    "network": {"model": {"encoder": "resnet18"}},  # a section this test need not know
}


def merged(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def record(db: ResultsDB, config: dict, seed: int, peak_mb: float, val: float,
           gpu: str | None = None) -> None:
    config = merged(config, {"train": {"seed": seed}, "data": {"seed": seed}})
    metrics = [(0, p, k, v) for p in ("forward", "backward", "step")
               for k, v in (("tensor_peak_bytes", peak_mb * MB), ("tensor_start_bytes", 10 * MB))]
    metrics.append((0, "run", "step_time_s", 0.1 + peak_mb / 1000))
    db.record(RunRecord(config=config, config_hash=f"{len(db.runs())}", status="ok",
                        name="+".join(config["techniques"]) or "original",
                        env={"device": "cpu"} if gpu is None else {"device": "cuda:0", "gpu_name": gpu},
                        started_at=0.0, metrics=metrics,
                        epochs=[{"epoch": 0, "steps": 2, "train_loss": val, "val_loss": val,
                                 "val_ssim": 0.5, "val_psnr": 20.0, "time_s": 1.0}]))


@pytest.fixture
def db(tmp_path):
    """Two seeds of the base experiment (one row of n = 2), then one run of each variant."""
    db = ResultsDB(tmp_path / "mixed.sqlite")
    record(db, BASE, seed=0, peak_mb=100, val=0.30)
    record(db, BASE, seed=1, peak_mb=100, val=0.32)
    for i, over in enumerate(VARIANTS.values()):
        record(db, merged(BASE, over), seed=0, peak_mb=200 + 10 * i, val=0.5 + i / 100)
    return db


def test_only_seeds_are_averaged(db):
    rows = report.phase_memory(db)
    assert sorted(r["runs"] for r in rows) == [1] * len(VARIANTS) + [2]  # nothing else merged
    assert len({r["differs"] for r in rows}) == len(rows)  # each row says what sets it apart
    for table in (report.losses(db), report.pareto(db), report.phase_peaks(db)):
        assert len(table) == len(VARIANTS) + 1 and len({r["differs"] for r in table}) == len(table)
    (base,) = [r for r in report.losses(db) if r["runs"] == 2]
    assert base["val_loss"] == pytest.approx(0.31)


def test_what_differs_is_named(db):
    shown = {r["differs"] for r in report.phase_memory(db)}
    assert any("data.path=/data/a" in d for d in shown)
    assert any("data.resize=stretch" in d for d in shown)
    assert any("data.train_images=48" in d for d in shown)
    assert any("train.lr=0.01" in d for d in shown) and any("train.epochs=3" in d for d in shown)
    assert any("model.encoder=resnet18" in d for d in shown)
    lines = {r["differs"] for r in report.memory_vs_resolution(db)}  # a plotted line each
    assert len(lines) == len(VARIANTS) + 1
    term = report.build_report(db, "term")
    assert "settings that differ" in term and "data.train_images=48" in term


def test_no_column_where_nothing_differs(tmp_path):
    db = ResultsDB(tmp_path / "plain.sqlite")
    record(db, BASE, seed=0, peak_mb=100, val=0.3)
    record(db, merged(BASE, {"techniques": ["checkpoint"]}), seed=0, peak_mb=50, val=0.3)
    assert "settings that differ" not in report.build_report(db, "term")


def test_settings_an_older_memstudy_did_not_record_read_as_their_defaults(tmp_path):
    """A run recorded before a setting existed is the same experiment as one with the
    setting at its default: one row of two runs."""
    db = ResultsDB(tmp_path / "old.sqlite")
    record(db, BASE, seed=0, peak_mb=100, val=0.3)
    full = report.load_runs(db)[0]
    defaults = {k: v for k, v in settings(full).items() if "." in k}
    explicit = copy.deepcopy(BASE)
    for key, value in defaults.items():  # every setting spelled out, as a newer run stores it
        section, name = key.split(".", 1)
        if "." not in name:
            explicit.setdefault(section, {})[name] = json.loads(value)
    record(db, explicit, seed=1, peak_mb=100, val=0.3)
    (row,) = report.phase_memory(db)
    assert row["runs"] == 2


def test_ratios_compare_with_an_original_of_the_same_settings(db):
    record(db, merged(BASE, {"techniques": ["checkpoint"], "train": {"lr": 1e-2}}), seed=0,
           peak_mb=30, val=0.3)
    (ratio,) = report.memory_ratios(db)  # checkpoint at lr 0.01: original's run at lr 0.01
    lr_run = next(r for r in report.phase_memory(db)
                  if r["name"] == "original" and "train.lr=0.01" in r["differs"])
    assert ratio["forward"] == pytest.approx(30 / lr_run["forward_mb"])


def test_advise_fits_each_experiment_apart(tmp_path):
    """Two experiments of one set at two sizes each: two lines, never one through all four."""
    db = ResultsDB(tmp_path / "advise.sqlite")
    for size, peak in ((128, 100), (256, 400)):
        record(db, merged(BASE, {"train": {"image_size": size}}), 0, peak, 0.3, gpu="G")
    for size, peak in ((128, 200), (256, 800)):
        over = {"train": {"image_size": size}, "data": {"source": "folder", "path": "/d"}}
        record(db, merged(BASE, over), 0, peak, 0.3, gpu="G")
    _device, preds, _skipped = advise.predict_all(db, "4GiB", 512)
    assert [p.name for p in preds] == ["original", "original"]
    assert sorted(p.differs for p in preds) == ["data.path=/d, data.source=folder",
                                                "data.path=null, data.source=synthetic"]
    assert "settings that differ" in advise.describe("G", 512, "4GiB", preds)


def test_largest_size_names_what_sets_two_searches_apart(tmp_path):
    """Two maxres searches of one set and budget under other settings: two rows, told apart by
    their probes' stored configs (maxres keys a search by its config without the size)."""
    from memstudy import maxres
    from memstudy.config import RunConfig
    from memstudy.runner import resolved
    from memstudy.store import PROBE_LABEL

    db = ResultsDB(tmp_path / "maxres.sqlite")
    for lr in (1e-3, 1e-2):
        template = RunConfig()
        template.train.device, template.train.lr, template.budget = "cpu", lr, "1GiB"
        probe = resolved(maxres.probe_config(maxres.prepare_template(template), ["checkpoint"], 256))
        db.record(RunRecord(config=probe.to_dict(), config_hash=probe.hash(), name="checkpoint",
                            status="ok", env={"device": "cpu"}, started_at=0.0, label=PROBE_LABEL))
        maxres.store_result(db.path, template, maxres.MaxresResult(
            "checkpoint", ["checkpoint"], "1GiB", 2**30, [256], found_px=256))
    rows = report.largest_size(db)
    assert sorted(r["differs"] for r in rows) == ["train.lr=0.001", "train.lr=0.01"]
    assert "settings that differ" in report.render("largest_size", rows)
