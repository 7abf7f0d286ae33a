"""The tuned baseline: channels_last / cudnn_benchmark as recorded run settings, plain steps
with no meter work, the first step's time and the fragmentation figure."""
from __future__ import annotations

import pytest
import torch

from conftest import small_config
from memstudy.errors import ConfigError
from memstudy.meters import PhaseRecorder
from memstudy.runner import execute
from memstudy.store import ResultsDB
from memstudy.techniques.compose import build_pipeline, make_plan


def test_tuning_settings_are_resolved_and_stored(tmp_path):
    db = ResultsDB(tmp_path / "r.sqlite")
    cfg = small_config(max_steps=2, validate=False)
    assert cfg.train.channels_last is None and cfg.train.cudnn_benchmark is None  # unset
    rec = execute(cfg, db)
    assert rec.status == "ok", rec.error
    # on the CPU the unset settings resolve to off, and the stored row says so
    assert (rec.config["train"]["channels_last"], rec.config["train"]["cudnn_benchmark"]) == (False, False)
    stored = db.runs()[-1]
    assert '"channels_last": false' in stored["config_json"]
    assert '"cudnn_benchmark": false' in stored["config_json"]


def test_channels_last_is_applied_and_hashed_apart():
    plain = small_config()
    nhwc = small_config(channels_last=True)
    build = build_pipeline(make_plan(nhwc))
    conv = build.model.encoder.layer1[0].conv1.weight  # 64 -> 64 channels: the layouts differ
    layout = (conv.is_contiguous(memory_format=torch.channels_last), conv.is_contiguous())
    assert layout == (True, False)
    assert not torch.backends.cudnn.benchmark  # set (off) on every build
    assert plain.hash() != nhwc.hash()


@pytest.mark.parametrize("setting, value, fragment", [
    ("cudnn_benchmark", True, "train.cudnn_benchmark = true needs a CUDA GPU"),
    ("channels_last", "yes", "train.channels_last must be true or false"),
    ("cudnn_benchmark", 1, "train.cudnn_benchmark must be true or false"),
    ("val_precision", "fp16", "train.val_precision 'fp16' unknown"),
])
def test_bad_tuning_settings_are_refused(setting, value, fragment):
    with pytest.raises(ConfigError, match=fragment):
        make_plan(small_config(**{setting: value}))


def test_plain_steps_do_no_meter_work(monkeypatch):
    """Warm-up (after the first) and plain steps: no synchronisation inside the step, no
    memory statistics, no per-phase records; a plain step is timed with one sync at each end."""
    calls = {"sync": [], "before": 0}
    monkeypatch.setattr(PhaseRecorder, "_sync", lambda self: calls["sync"].append(self._step_id))
    original_before = PhaseRecorder._before

    def counting_before(self, rec):
        calls["before"] += 1
        original_before(self, rec)

    monkeypatch.setattr(PhaseRecorder, "_before", counting_before)
    cfg = small_config(warmup_steps=2, measure_steps=1, max_steps=5, validate=False)
    cfg.data.train_images = 5
    rec = execute(cfg, db=None)
    assert rec.status == "ok", rec.error
    per_step = {step: calls["sync"].count(step) for step in range(1, 6)}
    # step 1: first (timed, 2); step 2: warm-up (none); step 3: measured (2 + 2 per phase);
    # steps 4-5: plain (2 each)
    assert per_step == {1: 2, 2: 0, 3: 2 + 2 * 3, 4: 2, 5: 2}, per_step
    assert calls["before"] == 3  # forward, backward, step of the measured step only
    run = {n: v for _, phase, n, v in rec.metrics if phase == "run"}
    assert run["first_step_time_s"] > 0 and "step_time_s" in run
    assert not any(n == "unmetered_time_s" for _, _, n, _ in rec.metrics)


def test_fragmentation_is_peak_reserved_minus_peak_allocated():
    rec = PhaseRecorder(torch.device("cpu"), torch.nn.Linear(1, 1), build_runtime(), lambda: None,
                        small_config().meter)
    rec.measured["forward"].append({"alloc_start_bytes": 100, "alloc_peak_bytes": 400,
                                    "reserved_peak_bytes": 800, "time_s": 0.1})
    rec.measured["backward"].append({"alloc_start_bytes": 300, "alloc_peak_bytes": 500,
                                     "reserved_peak_bytes": 1200, "time_s": 0.1})
    run = rec.summary()["run"]
    assert run["alloc_peak_total_bytes"] == 800
    assert run["reserved_peak_total_bytes"] == 1200
    assert run["fragmentation_bytes"] == 400


def test_alloc_retries_recorded_from_the_cuda_allocator(monkeypatch):
    """CUDA runs record the caching allocator's retry count (slow steps near a budget); the CPU
    has no such counter, so CPU runs do not record the figure."""
    rec = PhaseRecorder(torch.device("cpu"), torch.nn.Linear(1, 1), build_runtime(), lambda: None,
                        small_config().meter)
    rec.measured["forward"].append({"alloc_start_bytes": 0, "alloc_peak_bytes": 1,
                                    "reserved_peak_bytes": 2, "time_s": 0.1})
    assert "alloc_retries" not in rec.summary()["run"]
    rec.cuda = True
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": 7})
    assert rec.summary()["run"]["alloc_retries"] == 7
    # the allocator counts per process: retries of an earlier run in it are not this run's
    rec.retries_before_run = 5
    assert rec.summary()["run"]["alloc_retries"] == 2


def build_runtime():
    return build_pipeline(make_plan(small_config())).runtime


@pytest.mark.gpu
def test_cuda_run_is_tuned_and_records_fragmentation():
    cfg = small_config(512, max_steps=5, validate=False)
    cfg.train.device = "cuda"
    cfg.data.train_images = 5
    rec = execute(cfg, db=None)
    assert rec.status == "ok", rec.error
    assert (rec.config["train"]["channels_last"], rec.config["train"]["cudnn_benchmark"]) == (True, True)
    assert torch.backends.cudnn.benchmark
    run = {n: v for _, phase, n, v in rec.metrics if phase == "run"}
    assert run["fragmentation_bytes"] == run["reserved_peak_total_bytes"] - run["alloc_peak_total_bytes"]
    assert run["fragmentation_bytes"] >= 0
    assert run["alloc_retries"] == 0  # 80 GB for a 512 px run: the allocator never hit a limit


def _step_op_counts(model: torch.nn.Module) -> dict[str, int]:
    """aten ops of one forward + backward at 64 px (the recomputation included)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        counts: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.counts[str(func.overloadpacket).removeprefix("aten.")] += 1
            return func(*args, **(kwargs or {}))

    counter = Counter()
    counter.counts = collections.Counter()
    with counter:
        model(torch.rand(1, 1, 64, 64)).mean().backward()
    return counter.counts


@pytest.mark.parametrize("lean", [False, True])
def test_overhead_loop_checkpoints_what_memstudy_checkpoints(monkeypatch, lean):
    """bench_overhead compares equal things: its hand loop recomputes the same convolutions
    and BatchNorms as memstudy's checkpoint:block (the loop's own checkpoint wrapping, run on
    the CPU here); memstudy's recomputation runs no op of a kind the loop's does not."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_overhead

    from memstudy.models import build_unet
    from memstudy.techniques.checkpoint import apply_per_block

    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    loop = _step_op_counts(bench_overhead.loop_model(True, lean))
    ours_model = build_unet().to(memory_format=torch.channels_last)
    apply_per_block(ours_model, selective=False)
    ours = _step_op_counts(ours_model.net)  # the smp U-Net itself, without the pad/crop wrapper
    for op in ("convolution", "convolution_backward", "native_batch_norm"):
        assert ours[op] == loop[op], op
    assert set(ours) - {"detach"} <= set(loop), set(ours) - set(loop)


def test_overhead_plan_gives_each_size_its_sets():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_overhead

    assert bench_overhead.parse_plan("2048=original,amp:bf16;4160=amp:bf16+checkpoint", "", "") == [
        (2048, ["original", "amp:bf16"]), (4160, ["amp:bf16+checkpoint"])]
    assert bench_overhead.parse_plan(None, "2048,4160", "amp:bf16") == [
        (2048, ["amp:bf16"]), (4160, ["amp:bf16"])]


def test_bench_overhead_alternates_the_sides_and_pools_their_rounds():
    """Rounds run loop, lean loop, memstudy in turn; each side's figure is the mean of its
    rounds' medians, and the ratio is memstudy's over the loop's (timers stubbed: no GPU)."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import bench_overhead

    order, loop_times, ours_times = [], iter([0.10, 0.12, 0.20, 0.22]), iter([0.105, 0.125])

    def loop_timer(pair, techniques, warmup, steps, lean=False):
        order.append("lean" if lean else "loop")
        return {"step_time_s": next(loop_times), "peak_alloc_bytes": 5 if lean else 7}

    def memstudy_timer(size, techniques, warmup, steps, cache_dir):
        order.append("memstudy")
        return {"step_time_s": next(ours_times), "peak_alloc_bytes": 9}

    args = argparse.Namespace(repeats=2, warmup=1, steps=3)
    row = bench_overhead.measure_row("amp:bf16+checkpoint", 2048, None, args, "",
                                     loop_timer=loop_timer, memstudy_timer=memstudy_timer)
    assert order == ["loop", "lean", "memstudy"] * 2
    assert row["loop"]["repeat_step_times_s"] == [0.10, 0.20]
    assert row["lean"]["repeat_step_times_s"] == [0.12, 0.22]
    assert row["loop"]["step_time_s"] == pytest.approx(0.15)
    assert row["memstudy"]["step_time_s"] == pytest.approx(0.115)
    assert row["ratio"] == pytest.approx(0.115 / 0.15)
    assert row["loop"]["peak_alloc_bytes"] == 7 and row["repeats"] == 2


def test_fsdp_resolves_channels_last_off_and_refuses_it_on():
    """FSDP2 shards only contiguous parameters (channels_last weights failed its setup on
    2 x H200, 2026-11-23): with fsdp on CUDA, unset channels_last resolves to off, on is refused."""
    from memstudy.config import RunConfig
    from memstudy.techniques.compose import check_config

    def fsdp_config(**train) -> RunConfig:
        cfg = RunConfig(techniques=["fsdp"], world_size=2)
        cfg.train.device, cfg.train.batch_size = "cuda", 2
        for name, value in train.items():
            setattr(cfg.train, name, value)
        return cfg

    unset = fsdp_config()
    check_config(unset)
    assert unset.train.channels_last is False and unset.train.cudnn_benchmark is True
    with pytest.raises(ConfigError, match="fsdp needs contiguous parameters.*channels_last"):
        check_config(fsdp_config(channels_last=True))
    plain = RunConfig(world_size=1)
    plain.train.device = "cuda"
    check_config(plain)
    assert plain.train.channels_last is True


def test_an_elastic_batch_resolves_cudnn_benchmark_off_unless_set():
    """Each new batch size is a new shape for cuDNN's autotuner, timed inside the epoch
    (tri_accel's elastic batch, H100, 2026-11-23): unset resolves to off, explicit on stays."""
    from memstudy.config import RunConfig
    from memstudy.techniques.compose import check_config

    def tri(spec: str, **train) -> RunConfig:
        cfg = RunConfig(techniques=[spec])
        cfg.train.device = "cuda"
        for name, value in train.items():
            setattr(cfg.train, name, value)
        check_config(cfg)
        return cfg

    assert tri("tri_accel").train.cudnn_benchmark is False
    assert tri("tri_accel", cudnn_benchmark=True).train.cudnn_benchmark is True
    assert tri("tri_accel:elastic=off").train.cudnn_benchmark is True
    assert tri("tri_accel").train.channels_last is True


def test_a_setting_added_later_keeps_earlier_hashes_at_its_default():
    """train.val_precision came after recorded runs: at its default ("run", what they did) the
    hash is the one they were stored under, so they still resume; float32 hashes apart."""
    import hashlib
    import json

    from memstudy.config import HASH_SCHEMA

    cfg = small_config()
    before = cfg.to_dict()
    before.pop("label")
    del before["train"]["val_precision"]
    del before["meter"]["profile"]  # added later too, also neutral at its default
    del before["train"]["task"]  # so is the task ("enhance")
    del before["model"]  # and the network section (the study's U-Net)
    before["hash_schema"] = HASH_SCHEMA
    digest = hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    assert cfg.hash() == digest
    assert small_config(val_precision="float32").hash() != digest


@pytest.mark.parametrize("techniques", [["fsdp"], ["tri_accel"]])
def test_a_config_hashed_before_its_check_hashes_as_the_run(techniques):
    """Grids and tune hash configs before they are checked (runner.resolved); the techniques'
    defaults must apply there too, or a recorded cell would never be found again."""
    import copy

    from memstudy.config import RunConfig
    from memstudy.runner import resolved

    cfg = RunConfig(techniques=techniques, world_size=2 if techniques == ["fsdp"] else 1)
    cfg.train.device, cfg.train.batch_size = "cuda", 2
    planned = resolved(copy.deepcopy(cfg)).hash()
    cfg.check()
    assert resolved(cfg).hash() == planned


def test_each_steps_allocator_retries_are_a_series_row(monkeypatch):
    """The per-step series holds each step's own retries (the counter's change), so retries in
    timed steps can be told from the first steps' (cuDNN autotuning)."""
    from memstudy.train import TrainState, _record_alloc_retries

    counts = iter([3, 3, 5])
    monkeypatch.setattr(torch.cuda, "memory_stats",
                        lambda device=None: {"num_alloc_retries": next(counts)})
    state = TrainState()
    for step in (1, 2, 3):
        state.step = step
        _record_alloc_retries(state, 0, torch.device("cuda"))
    assert state.series == [(0, 1, "alloc_retries", 3), (0, 2, "alloc_retries", 0),
                            (0, 3, "alloc_retries", 2)]
