"""Grid specs: expansion and validation; isolated cells, timeout, and resume after kills."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memstudy.cli import main
from memstudy.errors import ConfigError
from memstudy.grid import expand, load_spec, product_sets, run_grid, spec_from_dict, to_toml
from memstudy.store import ResultsDB

BASE = {"train": {"device": "cpu", "validate": False, "warmup_steps": 0, "measure_steps": 1},
        "data": {"train_images": 1, "val_images": 1}}


def write_spec(tmp_path: Path, sizes: list[int], **extra) -> Path:
    spec = {"name": "t", "image_sizes": sizes, "steps": 1, "base": BASE, **extra}
    path = tmp_path / "spec.toml"
    path.write_text(to_toml(spec))
    return path


def test_product_sets():
    assert product_sets({"amp": ["off", "bf16"], "checkpoint": ["off", "on"]}) == [
        [], ["checkpoint"], ["amp:bf16"], ["amp:bf16", "checkpoint"]]
    with pytest.raises(ConfigError, match="product.amp"):
        product_sets({"amp": []})


def test_expansion_reports_invalid_cells_with_their_reason():
    spec = spec_from_dict({"techniques": ["original", "nosuch:1", "none"], "image_sizes": [192, 100],
                           "seeds": [0, 1], "steps": 1, "base": BASE})
    cells = expand(spec)
    # 'none' is 'original' again: 2 technique sets x 2 sizes x 2 seeds
    assert len(cells) == 8
    valid = [c for c in cells if c.error is None]
    assert [(c.name, c.config.train.image_size, c.config.train.seed) for c in valid] == [
        ("original", 192, 0), ("original", 192, 1)]
    assert len({c.hash for c in valid}) == 2
    reasons = {c.error for c in cells if c.error}
    assert any("unknown technique 'nosuch'" in r for r in reasons)
    # 100 px is below MS-SSIM's minimum side (any side >= 161 is accepted since sizes are padded)
    assert any("train.image_size 100 is too small" in r for r in reasons)
    for c in cells:  # cell settings come from the spec, the rest from [base]
        assert c.config.train.max_steps == 1 and c.config.data.train_images == 1


def test_expansion_refuses_a_cell_whose_warm_up_takes_every_step():
    """3 phantoms at batch 4 are one step: after a warm-up step there is nothing to measure."""
    spec = spec_from_dict({"techniques": ["original"], "image_sizes": [192], "batch_sizes": [1, 4],
                           "epochs": 1, "base": {"train": {**BASE["train"], "warmup_steps": 1},
                                                 "data": {"train_images": 3, "val_images": 1}}})
    cells = expand(spec)
    assert [c.error is None for c in cells] == [True, False]
    assert "takes 1 optimizer step(s)" in cells[1].error and "leaves none to measure" in cells[1].error


def test_spec_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="unknown grid key"):
        spec_from_dict({"sizes": [256]})
    with pytest.raises(ConfigError, match="image_sizes"):
        spec_from_dict({"image_sizes": "256"})
    with pytest.raises(ConfigError, match="both epochs and steps"):
        spec_from_dict({"epochs": 1, "steps": 2})
    with pytest.raises(ConfigError, match="unknown key"):
        expand(spec_from_dict({"base": {"train": {"sizee": 1}}}))
    with pytest.raises(ConfigError, match="not found"):
        load_spec(tmp_path / "missing.toml")


def test_dry_run_runs_nothing(tmp_path, capsys):
    db = tmp_path / "r.sqlite"
    spec = write_spec(tmp_path, [192, 100])
    assert main(["--db", str(db), "grid", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "to run" in out and "invalid: train.image_size 100" in out
    assert ResultsDB(db).runs() == []


def test_seeds_runs_a_subset_of_the_spec_seeds_as_the_spec_own_cells(tmp_path, capsys):
    """--seeds 2 lists only seed 2's cells, with the hashes the whole spec gives them (a later
    run of the whole spec skips them); a seed the spec lacks is one line naming its seeds."""
    db, spec = tmp_path / "r.sqlite", write_spec(tmp_path, [192], seeds=[0, 2])
    whole = {c.config.train.seed: c.hash for c in expand(load_spec(spec))}
    assert main(["--db", str(db), "grid", str(spec), "--dry-run", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert whole[2][:8] in out and whole[0][:8] not in out
    assert main(["--db", str(db), "grid", str(spec), "--dry-run", "--seeds", "2,5"]) != 0
    err = capsys.readouterr().err
    assert "seed 5 is not among" in err and "seeds [0, 2]; give some" in err


def test_start_within_lets_the_running_cell_finish_and_leaves_the_rest(tmp_path):
    db = tmp_path / "r.sqlite"
    spec = load_spec(write_spec(tmp_path, [192], seeds=[0, 1]))
    result = run_grid(spec, db, poll_s=0.05, start_within=0.2)  # the first starts at once
    assert result.outcomes == {1: "ok", 2: "not started (--start-within passed)"}
    assert result.ran == [1] and result.not_started == [2] and not result.failed
    assert run_grid(spec, db, poll_s=0.05).outcomes == {1: "recorded earlier (skipped)", 2: "ok"}


def test_timeout_is_recorded_and_not_rerun(tmp_path):
    db = tmp_path / "r.sqlite"
    spec = load_spec(write_spec(tmp_path, [192], timeout_s=0.5))
    result = run_grid(spec, db, poll_s=0.05)
    assert result.outcomes == {1: "error in timeout"}
    (run,) = ResultsDB(db).runs()
    assert (run["status"], run["failed_phase"]) == ("error", "timeout")
    assert "--retry timeout --timeout" in run["error"]  # the advice names a command that works
    assert run_grid(spec, db).outcomes == {1: "recorded earlier (skipped)"}
    assert len(ResultsDB(db).runs()) == 1
    spec.timeout_s = None  # as `--retry timeout --timeout` with time enough
    assert run_grid(spec, db, retry=frozenset({"timeout"})).outcomes == {1: "ok"}
    assert [r["status"] for r in ResultsDB(db).runs()] == ["error", "ok"]  # both attempts kept


def test_a_grid_caches_its_images_and_says_where_each_cells_time_went(tmp_path, monkeypatch):
    """The runner has the fork server cache the cells' images before they start, and its line
    for a recorded cell splits the cell's wall time into start, steps (the epochs' recorded
    time), the rest of the run and the end, which add up to the wall time."""
    import re

    monkeypatch.delenv("MEMSTUDY_CACHE", raising=False)
    lines: list[str] = []
    spec = load_spec(write_spec(tmp_path, [192]))
    assert run_grid(spec, tmp_path / "r.sqlite", progress=lines.append, poll_s=0.05).outcomes == {1: "ok"}
    assert "fork server ready and the images of 1 (data, size) cached" in lines[0]
    assert len(list((tmp_path / "r.cells" / "phantoms").glob("*.npy"))) == 2  # 1 train, 1 val
    (line,) = [x for x in lines if ": ok (" in x]
    found = re.search(r"\((\S+) s: start (\S+) s, steps (\S+) s \(first (\S+) s\), build and "
                      r"validation (\S+) s, end (\S+) s\)", line)
    assert found, line
    wall, start, steps, first, within, end = map(float, found.groups())
    db = ResultsDB(tmp_path / "r.sqlite")
    (run,) = db.runs()
    epochs = db.query("SELECT SUM(time_s) AS s FROM epochs WHERE run_id = ?", (run["id"],))[0]["s"]
    assert steps == pytest.approx(epochs, abs=0.051)
    assert 0 < first <= steps + 0.05 and min(start, within, end) >= 0
    assert start + steps + within + end == pytest.approx(wall, abs=0.26)  # 5 figures rounded


def test_the_quick_gpu_study_stays_quick():
    """examples/gpu.toml is the quick study (./dev/study on a GPU; docs/grid.md gives its time
    on an H100): no compiling set, no cuDNN autotuning, and no more cells x steps than the
    content that was timed (27 cells of 8 steps), so a set added to it is timed again."""
    from memstudy.grid.spec import cell_config
    from memstudy.techniques import declaring, planned_steps

    spec = load_spec(Path(__file__).parents[1] / "examples/gpu.toml")
    assert spec.base["train"]["cudnn_benchmark"] is False
    work = 0
    for techniques in spec.technique_sets:
        assert not declaring(techniques, "compiles"), techniques
        for size in spec.image_sizes:
            cfg = cell_config(spec, techniques, size, spec.batch_sizes[0], spec.seeds[0], 1)
            work += planned_steps(cfg, cfg.data.train_images)
    assert work <= 27 * 8, work


def _children(pid: int, running: str) -> list[int]:
    """Processes under `pid` (children, or a fork server's children) whose output goes to the
    log of the cell `running` (its hash names the log)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue

    def under(p: int) -> bool:
        while p in parents and p != pid:
            p = parents[p]
        return p == pid

    found = []
    for p in parents:
        try:
            log = os.readlink(f"/proc/{p}/fd/1")
        except OSError:
            continue
        if p != pid and running in log and under(p):
            found.append(p)
    return found


def _wait(condition, timeout: float = 120.0, what: str = ""):
    end = time.time() + timeout
    while time.time() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.slow
def test_resume_after_killing_a_cell_and_the_runner(tmp_path):
    db = tmp_path / "r.sqlite"
    # cell 2 is the larger, so that it is still running when its process is found and killed
    # (at 224 px a fast machine finished it within the second the kill used to wait)
    spec_path = write_spec(tmp_path, [192, 512])
    cmd = [sys.executable, "-m", "memstudy", "--db", str(db), "grid", str(spec_path), "-q"]
    cell2 = expand(load_spec(spec_path))[1].hash

    def start_and_kill(kill_runner: bool) -> subprocess.Popen:
        runner = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _wait(lambda: len(ResultsDB(db).runs()) >= 1, what="cell 1 to be recorded")
        (child,) = _wait(lambda: _children(runner.pid, cell2), what="the child of cell 2")
        os.kill(runner.pid if kill_runner else child, signal.SIGKILL)
        runner.wait(timeout=120)
        _wait(lambda: not _alive(child), 30, "cell 2 to die with its runner")
        return runner

    # 1. SIGKILL cell 2's process: the runner reports it killed and records nothing for it
    runner = start_and_kill(kill_runner=False)
    assert runner.returncode == 1, runner.stdout.read()
    assert "killed by signal 9" in runner.stdout.read()
    assert [r["image_size"] for r in ResultsDB(db).runs()] == [192]
    assert ResultsDB(db).query("SELECT * FROM claims") == []  # the runner released it
    # 2. a rerun skips cell 1; SIGKILL the runner while cell 2 runs: the cell dies with it,
    # and its claim stays behind, held by a runner that no longer exists
    start_and_kill(kill_runner=True)
    assert [r["image_size"] for r in ResultsDB(db).runs()] == [192]
    assert [c["config_hash"] for c in ResultsDB(db).query("SELECT * FROM claims")] == [cell2]
    # 3. a rerun takes the dead runner's claim over and runs cell 2 only; no duplicate rows
    result = run_grid(load_spec(spec_path), db)
    assert result.outcomes == {1: "recorded earlier (skipped)", 2: "ok"}
    runs = ResultsDB(db).runs()
    assert sorted(r["image_size"] for r in runs) == [192, 512]
    assert len({r["config_hash"] for r in runs}) == 2


def test_cells_per_gpu_seats_cells_side_by_side_emptiest_gpu_first():
    from memstudy.grid import GpuSlots

    slots = GpuSlots(["0", "1"], per_gpu=2)
    assert [slots.take(1) for _ in range(4)] == [["0"], ["1"], ["0"], ["1"]]
    assert slots.take(1) is None and slots.width == 4
    slots.give(["1"])
    assert slots.take(2) is None  # a 2-GPU cell needs a seat on both
    slots.give(["0"])
    assert slots.take(2) == ["0", "1"]
    slots.give(["0", "1"]), slots.give(["0"]), slots.give(["1"])
    with pytest.raises(RuntimeError, match="given back twice"):
        slots.give(["1"])


def test_cells_per_gpu_refuses_budgets_and_other_launchers(tmp_path, capsys):
    (tmp_path / "gpu").mkdir()
    spec = write_spec(tmp_path, [192])
    db = str(tmp_path / "r.sqlite")
    gpu_spec = write_spec(tmp_path / "gpu", [192],
                          base={**BASE, "train": {**BASE["train"], "device": "cuda"}})
    for extra, message in (
            (["--cells-per-gpu", "0"], "--cells-per-gpu 0: give 1 or more"),
            (["--cells-per-gpu", "2", "--budget", "4GiB"], "with a memory budget (original 192px"),
            (["--cells-per-gpu", "2", "--launcher", "submitit-local"],
             "--cells-per-gpu applies to --launcher processes")):
        assert main(["--db", db, "grid", str(gpu_spec), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("memstudy: error: ") and message in err and err.count("\n") == 1, err
    # a run on two GPUs records no neighbours: its times would pass for its own
    (tmp_path / "dp").mkdir()
    dp_spec = write_spec(tmp_path / "dp", [192], techniques=["dp"], batch_sizes=[2],
                         base={**BASE, "world_size": 2, "train": {**BASE["train"], "device": "cuda"}})
    for extra, message in ((["--cells-per-gpu", "2"], "with cells on several GPUs (dp 192px"),):
        assert main(["--db", db, "grid", str(dp_spec), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("memstudy: error: ") and message in err and err.count("\n") == 1, err
    assert not os.path.exists(db)  # refused before anything was created
    # CPU cells have no GPU to share: a budget is fine there
    assert main(["--db", db, "grid", str(spec), "--cells-per-gpu", "2", "--budget", "4GiB",
                 "--dry-run"]) == 0


def test_cells_side_by_side_share_the_hosts_cpu_threads(monkeypatch):
    from memstudy.grid.scheduler import cell_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cell_threads(1, cores=16) is None  # one cell at a time keeps torch's default
    assert (cell_threads(4, cores=16), cell_threads(3, cores=16), cell_threads(32, cores=16)) == (4, 5, 1)
    assert (cell_threads(2, cores=16), cell_threads(2, cores=3)) == (8, 1)  # two cells: halves
    monkeypatch.setattr("os.cpu_count", lambda: 16)  # cores not given: the host's
    assert cell_threads(2) == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice, inherited by every cell
    assert cell_threads(4, cores=16) is None


@pytest.mark.slow
def test_a_cell_runs_with_the_threads_it_was_given(tmp_path, monkeypatch):
    """The cell's process takes its share (recorded in the run's env as num_threads); a bad
    value is refused before anything is recorded."""
    from memstudy.config import CELL_THREADS_ENV
    from memstudy.grid.cells import CellProcess
    from memstudy.runner import share_cpu_threads

    cell = expand(load_spec(write_spec(tmp_path, [192])))[0]
    # 3: neither of the defaults the cell would inherit here (OMP_NUM_THREADS is 1 or 2 in
    # the test processes: conftest.py)
    child = CellProcess(cell.config, tmp_path / "r.sqlite", None, threads=3)
    child.proc.wait()
    assert child.finish() == "ok"
    (run,) = ResultsDB(tmp_path / "r.sqlite").runs()
    assert json.loads(run["env_json"])["num_threads"] == 3
    monkeypatch.setenv(CELL_THREADS_ENV, "0")
    with pytest.raises(ConfigError, match=f"{CELL_THREADS_ENV}='0' must be a positive number"):
        share_cpu_threads()


@pytest.mark.gpu
@pytest.mark.slow
def test_cells_side_by_side_on_one_gpu_record_that_they_shared_it(tmp_path):
    """Two cells at once on GPU 0 (--cells-per-gpu 2): each saw the other (where NVML lists
    processes), and the reports leave their times out."""
    from memstudy.report.data import load_runs, step_time

    gpu_base = {**BASE, "train": {**BASE["train"], "device": "cuda", "epochs": 3},
                "data": {"train_images": 4, "val_images": 1}}
    spec = spec_from_dict({"image_sizes": [256], "seeds": [0, 2], "base": gpu_base})
    result = run_grid(spec, tmp_path / "r.sqlite", gpus=["0"], per_gpu=2)
    assert set(result.outcomes.values()) == {"ok"}
    runs = load_runs(tmp_path / "r.sqlite")
    seen = [r["metrics"]["run"].get("gpu_other_processes") for r in runs]
    if seen == [None, None]:
        pytest.skip("NVML lists no process on this GPU (not even the cell's own)")
    # at least each other (the test's own process may hold a context on the GPU too)
    assert all(n is not None and n >= 1 for n in seen), seen
    assert [step_time(r) for r in runs] == [None, None]


@pytest.mark.gpu
@pytest.mark.alone
def test_gpu_cells_spread_over_visible_gpus(tmp_path):
    import torch

    gpu_base = {**BASE, "train": {**BASE["train"], "device": "cuda", "warmup_steps": 1},
                "data": {"train_images": 2, "val_images": 1}}  # a budget needs a warm-up step
    # two cells: one each where two GPUs are visible (seed 1: a dead start, docs/paper.md)
    spec = spec_from_dict({"image_sizes": [256], "seeds": [0, 2], "steps": 2,
                           "base": gpu_base, "budget": "8GiB"})
    result = run_grid(spec, tmp_path / "r.sqlite")
    assert set(result.outcomes.values()) == {"ok"}
    runs = ResultsDB(tmp_path / "r.sqlite").runs()
    assert len(runs) == 2 and all(r["gpu_name"] for r in runs)
    if torch.cuda.device_count() >= 2:  # the cells were spread over both GPUs
        assert len({json.loads(r["env_json"])["gpu_uuid"] for r in runs}) == 2


def test_gpu_slots_give_disjoint_sets_and_a_wide_cell_waits():
    from memstudy.grid import GpuSlots

    slots = GpuSlots(["0", "1"])
    one = slots.take(1)
    assert one == ["0"] and slots.take(2) is None  # the 2-GPU cell waits for both
    other = slots.take(1)
    assert other == ["1"] and not set(one) & set(other) and slots.take(1) is None
    slots.give(one)
    assert slots.take(2) is None  # GPU 1 still busy
    slots.give(other)
    both = slots.take(2)
    assert both == ["0", "1"] and slots.take(1) is None
    with pytest.raises(RuntimeError, match="given back twice"):
        slots.give(["0"]) or slots.give(["0"])
    cpu = slots.take(0)  # the CPU slot is separate, and one at a time
    assert cpu == [] and slots.take(0) is None
    slots.give(cpu)
    assert slots.take(0) == []


def test_scheduler_never_overlaps_gpus(monkeypatch, tmp_path):
    """Fake children on fake GPU ids: a 2-GPU cell and two 1-GPU cells on 2 GPUs."""
    from memstudy.grid import Cell, GpuSlots, GridResult, scheduler

    held: dict[str, int] = {}
    log: list[tuple[int, str | None]] = []

    class FakeChild:
        times = None  # where a recorded cell's time went: none here

        def __init__(self, config, db_path, gpu, threads=None):
            ids = gpu.split(",") if gpu else []
            assert not set(ids) & set(held), f"GPUs {ids} already held by {held}"
            held.update({g: config.train.seed for g in ids})
            self.ids, self.polls, self.started = ids, 0, time.time()
            log.append((config.train.seed, gpu))

        def poll(self):
            self.polls += 1
            if self.polls < 3:
                return None
            for g in self.ids:
                held.pop(g)
            return 0

        def finish(self, timed_out=False):
            return "ok"

    from conftest import small_config

    from memstudy.grid.claims import Runner

    cells = [Cell(index=i + 1, config=small_config(seed=i), hash=f"h{i}", gpus=n)
             for i, n in enumerate([1, 2, 1])]
    monkeypatch.setattr(scheduler, "CellProcess", FakeChild)
    result = GridResult(cells)
    scheduler._Scheduler(result, cells, GpuSlots(["3", "5"]), ResultsDB(tmp_path / "r.sqlite"),
                        None, lambda _m: None, 0.0, Runner.this_process()).run()
    assert result.outcomes == {1: "ok", 2: "ok", 3: "ok"}
    assert log == [(0, "3"), (1, "3,5"), (2, "3")]  # in order; the wide cell waited for both


def test_scheduler_seats_cells_per_gpu_and_shares_the_cpu(monkeypatch, tmp_path):
    """Fake children on 2 GPUs with 2 seats each: four 1-GPU cells start at once, two per GPU,
    the fifth waits for a seat; every GPU cell gets a quarter of the host's cores."""
    from memstudy.grid import Cell, GpuSlots, GridResult, scheduler

    running: dict[str, int] = {}  # GPU -> cells on it now
    most: dict[str, int] = {}
    given: list = []

    class FakeChild:
        times = None

        def __init__(self, config, db_path, gpu, threads=None):
            running[gpu] = running.get(gpu, 0) + 1
            most[gpu] = max(most.get(gpu, 0), running[gpu])
            self.gpu, self.polls, self.started = gpu, 0, time.time()
            given.append(threads)

        def poll(self):
            self.polls += 1
            if self.polls < 3:
                return None
            running[self.gpu] -= 1
            return 0

        def finish(self, timed_out=False):
            return "ok"

    from conftest import small_config

    from memstudy.grid.claims import Runner

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(scheduler.os, "cpu_count", lambda: 16)
    cells = [Cell(index=i + 1, config=small_config(seed=i), hash=f"h{i}", gpus=1) for i in range(5)]
    monkeypatch.setattr(scheduler, "CellProcess", FakeChild)
    result = GridResult(cells)
    scheduler._Scheduler(result, cells, GpuSlots(["0", "1"], per_gpu=2),
                        ResultsDB(tmp_path / "r.sqlite"), None, lambda _m: None, 0.0,
                        Runner.this_process()).run()
    assert set(result.outcomes.values()) == {"ok"} and len(result.outcomes) == 5
    assert most == {"0": 2, "1": 2} and given == [4] * 5


def test_world_size_cells_need_that_many_gpus(tmp_path):
    from memstudy.grid import gpus_needed
    from memstudy.grid.spec import Cell
    from memstudy.grid.scheduler import too_few_gpus
    from conftest import small_config

    cfg = small_config(techniques=["dp"], batch_size=2, warmup_steps=2)
    cfg.world_size = 2
    assert gpus_needed(cfg) == 0  # gloo processes on the CPU hold no GPU
    dp_base = {"train": {**BASE["train"], "warmup_steps": 2},  # dp asks for 2
               "data": {"train_images": 6, "val_images": 1}}  # three global batches
    spec = spec_from_dict({"techniques": ["original", "dp"], "world_sizes": [1, 2],
                           "batch_sizes": [2], "image_sizes": [192], "steps": 3, "base": dp_base})
    cells = expand(spec)
    assert [(c.name, c.config.world_size, c.error is None) for c in cells] == [
        ("original", 1, True), ("dp", 1, False), ("original", 2, False), ("dp", 2, True)]
    assert "world_size >= 2" in cells[1].error and "no distributed technique" in cells[2].error
    wide = Cell(index=1, config=cfg, gpus=2)
    msg = too_few_gpus(wide, ["0"], from_flag=True)
    assert "needs 2 GPUs" in msg and "world_size 2" in msg and "--gpus lists 1" in msg
    with pytest.raises(ConfigError, match="world_sizes"):
        spec_from_dict({"world_sizes": [0]})


@pytest.mark.slow
def test_cpu_grid_runs_a_dp_cell_on_two_processes(tmp_path):
    # dp refuses fewer than 2 warm-up steps (DDP rebuilds its buckets in step 2): 3 steps of
    # one global batch (one image per rank), the third measured
    base = {"world_size": 2,
            "train": {"device": "cpu", "validate": False, "warmup_steps": 2, "measure_steps": 1,
                      "epochs": 3},
            "data": {"train_images": 2, "val_images": 1}}
    spec = spec_from_dict({"techniques": ["dp"], "image_sizes": [192], "batch_sizes": [2],
                           "steps": 3, "base": base})
    db = tmp_path / "r.sqlite"
    result = run_grid(spec, db)
    logs = [p.read_text() for p in (tmp_path / "r.cells").glob("*.log")]
    assert result.outcomes == {1: "ok"}, logs
    (run,) = ResultsDB(db).runs()
    assert run["world_size"] == 2
    ranks = {rank for rank, _phase in ResultsDB(db).metrics(run["id"])}
    assert ranks == {0, 1, -1, -2}  # each rank's rows, their mean and their maximum


@pytest.mark.multigpu
def test_gpu_grid_gives_a_dp_cell_two_gpus(tmp_path):
    """A world_size-2 dp cell after a 1-GPU cell on 2 GPUs: both ok, the dp run has 2 ranks."""
    base = {"train": {"device": "cuda", "validate": False, "warmup_steps": 2, "measure_steps": 1},
            "data": {"train_images": 6, "val_images": 1}}  # 3 global batches: the third measured
    spec = spec_from_dict({"techniques": ["original", "dp"], "world_sizes": [1, 2],
                           "image_sizes": [256], "batch_sizes": [2], "steps": 3, "base": base})
    result = run_grid(spec, tmp_path / "r.sqlite", gpus=["0", "1"])
    outcomes = [result.outcomes[i] for i in sorted(result.outcomes)]
    # cells: original@1, dp@1 (refused), original@2 (refused), dp@2
    assert outcomes[0] == outcomes[3] == "ok", outcomes
    assert outcomes[1].startswith("invalid") and outcomes[2].startswith("invalid")
    runs = {r["world_size"]: r for r in ResultsDB(tmp_path / "r.sqlite").runs()}
    assert set(runs) == {1, 2}
    keys = ResultsDB(tmp_path / "r.sqlite").metrics(runs[2]["id"])
    assert {rank for rank, _ in keys} == {0, 1, -1, -2}
    assert {(0, "forward"), (1, "forward")} <= set(keys)  # each rank measured its step


@pytest.mark.parametrize("path, device", [("examples/quick.toml", "cpu"),
                                          ("examples/gpu.toml", "cuda"),
                                          ("examples/gpu-full.toml", "cuda"),
                                          ("examples/encoders.toml", "cuda")])
def test_shipped_grids_plan_on_the_device_they_name(path, device, monkeypatch):
    """Every cell of the example grids (the quick study's included) passes make_plan for its
    device, so a new set in them is not first refused on a GPU machine. Planned here for a
    CUDA device without one: Triton's check is taken as passed."""
    import copy

    import torch

    from memstudy.grid.spec import cell_config, load_spec
    from memstudy.techniques.compose import make_plan
    from memstudy.train import check_measurable

    monkeypatch.setattr("memstudy.techniques.compile.triton_cuda_problem", lambda device: None)
    spec = load_spec(Path(__file__).parents[1] / path)
    assert spec.base["train"]["device"] == device
    for encoder in spec.encoders:
        for techniques in spec.technique_sets:
            for size in spec.image_sizes:
                cfg = cell_config(spec, techniques, size, spec.batch_sizes[0], spec.seeds[0], 1,
                                  encoder)
                make_plan(copy.deepcopy(cfg), device=torch.device(device), n_gpus=1)
                check_measurable(cfg, cfg.data.train_images)


def test_a_grid_lists_encoders_as_it_lists_technique_sets(tmp_path):
    """Each encoder a cell of its own, under its own hash; a bad encoder name is that cell's
    one-line reason, the others still run."""
    from memstudy.grid.spec import expand, spec_from_dict

    spec = spec_from_dict({"encoders": ["resnet18", "resnet50", "resnet35"],
                           "techniques": ["original", "checkpoint"], "image_sizes": [192],
                           "base": {"train": {"device": "cpu"}}})
    cells = expand(spec)
    assert [c.config.model.encoder for c in cells] == ["resnet18"] * 2 + ["resnet50"] * 2 + [
        "resnet35"] * 2
    assert len({c.hash for c in cells[:4]}) == 4
    assert all("model.encoder = 'resnet35' is not a ResNet-family encoder" in c.error
               for c in cells[4:])
    with pytest.raises(ConfigError, match="grid encoders must be a list of str"):
        spec_from_dict({"encoders": "resnet18"})


def test_the_grid_has_the_fork_server_cache_each_data_and_size_once(tmp_path, monkeypatch):
    """cache_images hands the fork server each (data, size) of the cells once (techniques and
    batch sizes share the images), with the cache folder the cells read."""
    from memstudy.grid import cells as grid_cells

    asked: list = []

    class Server:
        def fill_caches(self, data):
            asked.append(data)

    monkeypatch.setattr(grid_cells.forkserver, "server", lambda: Server())
    monkeypatch.delenv("MEMSTUDY_CACHE", raising=False)
    spec = load_spec(write_spec(tmp_path, [192, "192x256", 192], batch_sizes=[1, 2],
                                techniques=["original", "checkpoint"]))
    grid_cells.cache_images([cell.config for cell in expand(spec) if not cell.error],
                            tmp_path / "r.sqlite")
    (data,) = asked
    assert sorted(str(d["config"]["train"]["image_size"]) for d in data) == ["192", "192x256"]
    assert {d["cache"] for d in data} == {str(tmp_path / "r.cells" / "phantoms")}
