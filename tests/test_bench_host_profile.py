"""bench_host_profile: Python's profiler around a run's timed steps only, and its page."""
import gc
import json
import sqlite3
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import bench_host_profile as host  # noqa: E402

import memstudy.train as train  # noqa: E402


def run_bench(out: Path, *options: str) -> int:
    """Four CPU steps at 64 px (one scale of MS-SSIM): a warm-up step, the metered one, two
    timed."""
    return host.main(["--out", str(out), "--device", "cpu", "--size", "64", "--steps", "4",
                      "--skip", "2", "-t", "checkpoint", "--set", "train.msssim_scales=1",
                      "--set", "data.train_images=4", "--set", "data.val_images=1", *options])


def test_only_the_steps_after_skip_are_profiled_and_the_step_is_restored(tmp_path):
    out = tmp_path / "host"
    code = run_bench(out, "--top", "5")
    page = (out / "host-profile.md").read_text()
    assert code == 0 and not isinstance(train._train_step, host.StepProfiler)
    assert "2 steps timed after 2, on the CPU, under cProfile" in page
    # one row per timed step, numbered from the first after --skip
    assert "\n| 3 | " in page and "\n| 4 | " in page and "\n| 2 | " not in page
    # the step function itself, once per profiled step, holds everything under it
    step_row = next(line for line in page.splitlines() if "memstudy/train.py" in line
                    and "_train_step" in line)
    assert step_row.split("|")[3].strip() == "1.0"
    assert "/work/" not in page and "/usr/" not in page  # no machine paths


def test_skip_must_leave_a_step_to_time_and_cover_warm_up_and_the_metered_step(capsys):
    for skip in ("4", "1"):
        with pytest.raises(SystemExit):
            host.parse_args(["--out", "x", "-t", "amp:bf16", "--steps", "4", "--skip", skip])
        assert "--skip must be at least 2 (a warm-up step and the metered one)" in \
            capsys.readouterr().err


def test_without_the_profiler_each_step_is_timed_with_the_collectors_pauses(tmp_path):
    out = tmp_path / "plain"
    code = run_bench(out, "--no-profile", "--gc-freeze")
    page = (out / "host-profile.md").read_text()
    assert code == 0 and "without a profiler; gc.freeze() before the first" in page
    assert "By own time" not in page
    # the timed steps are the run's plain ones: one warm-up step and one metered step before
    with sqlite3.connect(out / "host-profile.sqlite") as db:
        train_config = json.loads(db.execute("select config_json from runs").fetchone()[0])["train"]
    assert (train_config["warmup_steps"], train_config["measure_steps"]) == (1, 1)
    rows = [line.split("|") for line in page.splitlines() if line.startswith("| 3 |")
            or line.startswith("| 4 |")]
    assert len(rows) == 2 and all(float(row[2]) >= float(row[3]) >= 0 for row in rows)
    assert gc.get_freeze_count() == 0  # unfrozen again for whatever runs next
