"""bench_ladder --part native: the time column is relative to the tuned amp:bf16 step (amp:bf16
with pytorch-msssim's loss, what bench_overhead shows equals the hand-written loop), not to
memstudy's default amp:bf16, whose chunked loss is slower (H100, 2026-11-23: 3.42x, not 1.96x)."""
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import bench_ladder  # noqa: E402

from memstudy.store import ResultsDB, RunRecord  # noqa: E402


def _record(db: ResultsDB, label: str, step_s: float) -> None:
    config = {"train": {"image_size": 4188, "batch_size": 1}}
    db.record(RunRecord(config=config, config_hash=label, name=label, status="ok",
                        env={"device": "cuda", "gpu_name": "GPU"}, started_at=time.time(),
                        label=label, metrics=[(0, "run", "step_time_s", step_s)]))


def _ratios(db_path: Path) -> dict[str, str]:
    rows = [line.split(" | ") for line in bench_ladder.native_table(db_path) if line.startswith("| ")]
    header, body = rows[0], rows[1:]  # the separator row starts "|---"
    column = next(i for i, name in enumerate(header) if name.startswith("time /"))
    return {r[0].lstrip("| "): r[column] for r in body} | {"header": header[column]}


def test_native_time_is_relative_to_the_tuned_amp_bf16_step(tmp_path):
    db = ResultsDB(tmp_path / "native.sqlite")
    _record(db, "the set under 4GiB", 0.5)
    _record(db, bench_ladder.TUNED_LABEL, 0.125)
    _record(db, "amp:bf16 unconstrained", 0.25)
    ratios = _ratios(tmp_path / "native.sqlite")
    assert ratios["header"] == "time / tuned amp:bf16"
    assert ratios["the set under 4GiB"] == "4.00"
    assert ratios["amp:bf16 unconstrained"] == "2.00"


def test_native_without_a_tuned_row_says_what_it_divides_by(tmp_path):
    db = ResultsDB(tmp_path / "native.sqlite")
    _record(db, "the set under 4GiB", 0.5)
    _record(db, "amp:bf16 unconstrained", 0.25)
    ratios = _ratios(tmp_path / "native.sqlite")
    assert ratios["header"].startswith("time / amp:bf16 (chunked loss")
    assert ratios["the set under 4GiB"] == "2.00"


def test_native_runs_include_the_tuned_reference_with_the_unchunked_loss():
    args = bench_ladder.parse_args(["--part", "native", "--out", "x", "--no-float32"])
    runs = {label: settings for label, _, _, settings in bench_ladder.native_runs(args)}
    assert runs[bench_ladder.TUNED_LABEL] == ("train.loss_chunk_rows=0",)


def test_tuned_only_keeps_the_tuned_reference_alone():
    args = bench_ladder.parse_args(["--part", "native", "--out", "x", "--tuned-only"])
    references = [r[0] for r in bench_ladder.native_runs(args) if r[2] is None]
    assert references == [bench_ladder.TUNED_LABEL]


def test_native_tiled_settings_reach_the_tiled_runs_only_and_their_label():
    args = bench_ladder.parse_args(["--part", "native", "--out", "x", "--no-float32",
                                    "--tiled-settings", "train.loss_chunk_rows=1024"])
    runs = bench_ladder.native_runs(args)
    tiled = [r for r in runs if r[2] == "4GiB"]
    assert tiled and all(r[3] == ("train.loss_chunk_rows=1024",) for r in tiled)
    assert all(r[0].endswith(", train.loss_chunk_rows=1024") for r in tiled)
    assert all("train.loss_chunk_rows=1024" not in r[3] for r in runs if r[2] is None)


def test_a_tiled_sets_own_settings_reach_that_run_only():
    args = bench_ladder.parse_args(["--part", "native", "--out", "x", "--no-float32",
                                    "--tiled-set", "amp:bf16,tile:8;amp:bf16,tile:8|"
                                    "train.loss_chunk_rows=1024|train.seed=1"])
    tiled = [r for r in bench_ladder.native_runs(args) if r[2] == "4GiB"]
    assert [r[1] for r in tiled] == ["amp:bf16,tile:8", "amp:bf16,tile:8"]
    assert [r[3] for r in tiled] == [(), ("train.loss_chunk_rows=1024", "train.seed=1")]
    assert tiled[1][0].endswith(", train.loss_chunk_rows=1024, train.seed=1")
    assert tiled[0][0] == "amp:bf16,tile:8 under 4GiB"


def test_native_retries_split_the_timed_steps_from_the_warm_up(tmp_path):
    db = ResultsDB(tmp_path / "native.sqlite")
    config = {"train": {"image_size": 4188, "batch_size": 1, "warmup_steps": 2}}
    series = [(0, step, "alloc_retries", n) for step, n in [(1, 9), (2, 3), (3, 1), (4, 0)]]
    db.record(RunRecord(config=config, config_hash="s", name="s", status="ok",
                        env={"device": "cuda", "gpu_name": "GPU"}, started_at=time.time(),
                        label="the set under 4GiB", series=series,
                        metrics=[(0, "run", "step_time_s", 0.5), (0, "run", "alloc_retries", 13)]))
    _record(db, "amp:bf16 unconstrained", 0.25)  # recorded without the series
    rows = [line.split(" | ") for line in bench_ladder.native_table(tmp_path / "native.sqlite")
            if line.startswith("| ")]
    column = next(i for i, name in enumerate(rows[0]) if name.startswith("retries"))
    assert {r[0].lstrip("| "): r[column] for r in rows[1:]} == {
        "the set under 4GiB": "13 / 1", "amp:bf16 unconstrained": "-"}


def test_the_step_cell_shows_the_plain_steps_spread_where_recorded(tmp_path):
    db = ResultsDB(tmp_path / "native.sqlite")
    db.record(RunRecord(config={"train": {"image_size": 4188, "batch_size": 1}},
                        config_hash="s", name="s", status="ok",
                        env={"device": "cuda", "gpu_name": "GPU"}, started_at=time.time(),
                        label="the set under 4GiB",
                        metrics=[(0, "run", "step_time_s", 0.5), (0, "run", "plain_steps", 10),
                                 (0, "run", "step_time_min_s", 0.48),
                                 (0, "run", "step_time_max_s", 0.531)]))
    _record(db, bench_ladder.TUNED_LABEL, 0.125)  # recorded before the spread: median alone
    rows = [line.split(" | ") for line in bench_ladder.native_table(tmp_path / "native.sqlite")
            if line.startswith("| ")]
    column = rows[0].index("step s")
    assert {r[0].lstrip("| "): r[column] for r in rows[1:]} == {
        "the set under 4GiB": "0.500 (0.480-0.531 of 10)", bench_ladder.TUNED_LABEL: "0.125"}


def test_calibration_sets_name_their_plans_and_refuse_unknown_ones():
    """Each named plan at 256 and 1024 rows, streamed ones with their copies on the compute
    stream (what tile:auto's model fits); an unknown name is refused naming the known ones."""
    sets = bench_ladder.calibration_sets(["levels4-stream-blocks"]).split(";")
    assert [s.split(",")[3] for s in sets] == [
        f"tile:rows={rows}:levels=4:keep=conv1:layer1=blocks:stream=true:ahead=false"
        for rows in (256, 1024)]
    assert len(bench_ladder.AUTO_CALIBRATION_SETS.split(";")) == 2 * len(bench_ladder.AUTO_PLANS)
    with pytest.raises(SystemExit, match="levels9.*levels2, levels3"):
        bench_ladder.calibration_sets(["levels9"])
