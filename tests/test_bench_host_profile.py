"""bench_host_profile: Python's profiler around a run's timed steps only, and its page."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import bench_host_profile as host  # noqa: E402

import memstudy.train as train  # noqa: E402


def test_only_the_steps_after_skip_are_profiled_and_the_step_is_restored(tmp_path):
    out = tmp_path / "host"
    code = host.main(["--out", str(out), "--device", "cpu", "--size", "64", "--steps", "3",
                      "--skip", "1", "--top", "5", "-t", "checkpoint",
                      "--set", "train.msssim_scales=1", "--set", "data.train_images=3",
                      "--set", "data.val_images=1"])
    page = (out / "host-profile.md").read_text()
    assert code == 0 and not isinstance(train._train_step, host.StepProfiler)
    assert "2 steps profiled after 1, on the CPU" in page
    # the step function itself, once per profiled step, holds everything under it
    step_row = next(line for line in page.splitlines() if "memstudy/train.py" in line
                    and "_train_step" in line)
    assert step_row.split("|")[3].strip() == "1.0"
    assert "/work/" not in page and "/usr/" not in page  # no machine paths


def test_skip_must_leave_a_step_to_profile():
    with pytest.raises(SystemExit):
        host.parse_args(["--out", "x", "-t", "amp:bf16", "--steps", "4", "--skip", "4"])
