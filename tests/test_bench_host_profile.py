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
    assert code == 0 and "without Python's profiler; gc.freeze() before the first" in page
    assert "By own time" not in page
    # the timed steps are the run's plain ones: one warm-up step and one metered step before
    with sqlite3.connect(out / "host-profile.sqlite") as db:
        train_config = json.loads(db.execute("select config_json from runs").fetchone()[0])["train"]
    assert (train_config["warmup_steps"], train_config["measure_steps"]) == (1, 1)
    rows = [line.split("|") for line in page.splitlines() if line.startswith("| 3 |")
            or line.startswith("| 4 |")]
    assert len(rows) == 2 and all(float(row[2]) >= float(row[3]) >= 0 for row in rows)
    assert gc.get_freeze_count() == 0  # unfrozen again for whatever runs next


def test_the_gpu_timeline_splits_a_step_into_busy_copies_alone_and_idle():
    """Microsecond intervals as torch.profiler gives them: kernels 0-100 and 150-250, a copy
    to the device 80-160 (overlapping both) and two to the host 240-300 and 260-330 (one
    overlapping the last kernel, overlapping each other), in a 0.4 ms step."""
    copies = {"HtoD": [(80.0, 160.0)], "DtoH": [(240.0, 300.0), (260.0, 330.0)], "other": []}
    figures = host.gpu_figures([(0.0, 100.0), (150.0, 250.0)], copies, 0.4)
    assert figures == pytest.approx({"busy_ms": 0.33, "copies_alone_ms": 0.13, "idle_ms": 0.07,
                                     "kernels_ms": 0.2, "to_device_ms": 0.08,
                                     "to_host_ms": 0.09})


def test_the_gpu_timeline_sorts_copies_by_direction(monkeypatch):
    class Event:
        def __init__(self, name, start, end):
            self.name, self.time_range = name, type("Range", (), {"start": start, "end": end})

    events = [Event("Memcpy HtoD (Pinned -> Device)", 0, 10), Event("Memcpy DtoH (Device -> "
              "Pinned)", 5, 20), Event("Memset (Device)", 1, 2), Event("void conv_kernel", 3, 9)]
    monkeypatch.setattr(host, "on_gpu", lambda event: True)  # every event here ran on the GPU
    kernels, copies = host._intervals(events)
    assert kernels == [(3, 9)] and copies == {"HtoD": [(0, 10)], "DtoH": [(5, 20)],
                                              "other": [(1, 2)]}


def test_the_gpu_timeline_without_a_gpu_is_one_line_before_any_run(capsys, monkeypatch):
    monkeypatch.setattr(host.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        host.parse_args(["--out", "x", "-t", "amp:bf16", "--gpu-timeline"])
    assert "--gpu-timeline reads the GPU's own timeline: it needs --device cuda on a machine " \
        "with a GPU (here --device cuda, CUDA not available)" in capsys.readouterr().err


def test_the_steps_table_carries_the_gpu_columns_only_with_a_timeline():
    profiler = host.StepProfiler(skip=2, profile=False)
    profiler.walls_ms, profiler.gc_ms, profiler.gc_runs = [5.0], [0.5], [{0: 2}]
    assert host.steps_table(profiler)[2] == "| 3 | 5.0 | 0.5 | 0: 2 |"
    profiler.gpu = [{"busy_ms": 4.0, "copies_alone_ms": 1.25, "idle_ms": 1.0,
                     "kernels_ms": 2.75, "to_device_ms": 2.0, "to_host_ms": 0.5}]
    lines = host.steps_table(profiler)
    assert lines[0] == ("| step | wall ms | GPU busy ms | copies alone ms | GPU idle ms | "
                        "kernels ms | copying to the device ms | copying to the host ms | "
                        "gc pauses ms | collections (generation: count) |")
    assert lines[2] == "| 3 | 5.0 | 4.0 | 1.2 | 1.0 | 2.8 | 2.0 | 0.5 | 0.5 | 0: 2 |"


@pytest.mark.gpu
def test_the_gpu_timeline_of_real_steps_fits_inside_their_wall_time(tmp_path):
    code = run_bench(tmp_path / "gpu", "--no-profile", "--gpu-timeline", "--device", "cuda")
    page = (tmp_path / "gpu" / "host-profile.md").read_text()
    rows = [line.split("|") for line in page.splitlines() if line.startswith(("| 3 |", "| 4 |"))]
    assert code == 0 and len(rows) == 2 and "torch.profiler's CUDA activity" in page
    for row in rows:
        wall, busy, alone, idle = (float(row[i]) for i in (2, 3, 4, 5))
        assert 0 < busy <= wall + 0.1 and 0 <= alone <= busy and idle >= 0
