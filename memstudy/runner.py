"""Run one configuration end to end and record it: `execute(config, db)`.

Refusals (bad config, impossible technique combination, unreadable data) happen before
anything is built and record nothing. Once training starts, every outcome is recorded in
one transaction: ok, oom (with its phase), diverged (NaN / inf loss) or error, and whether the
training loss ever moved (`trained`, memstudy.did_train: a run whose loss is pinned at
MS-SSIM's clamp is ok as a measurement but did not train).
"""
from __future__ import annotations

import copy
import gc
import os
import random
import time
import traceback
from collections import Counter
from typing import Callable

import numpy as np
import torch

from memstudy.console import eprint  # also imported from here by scripts
from memstudy import cuda_allocator
from memstudy import env as envinfo
from memstudy.budget import apply_budget, recap_after_warmup
from memstudy.config import CELL_THREADS_ENV, RunConfig
from memstudy.datasets import build_datasets, describe_datasets
from memstudy.distributed.context import rank_device
from memstudy.distributed.records import gather_record
from memstudy.errors import ConfigError, Diverged, PhaseFailure
from memstudy.meters import PhaseRecorder
from memstudy.meters.flops import model_flops_per_step, pixel_count
from memstudy.meters.nvml import EnergyCounter
from memstudy.meters.profile import check_diagnosis_files
from memstudy.phases import STEP
from memstudy.quality import min_side
from memstudy.store import ResultsDB, RunRecord
from memstudy.techniques import Checked, applied, parse_techniques, resolve_run_settings
from memstudy.techniques.compose import build_pipeline, make_plan, prepare_process
from memstudy.did_train import judge, loss_ranges
from memstudy.train import TrainState, check_measurable, train


def run_name(config: RunConfig) -> str:
    return "+".join(config.techniques) if config.techniques else "original"


def resolved(config: RunConfig) -> RunConfig:
    """The config with techniques in canonical form and the device-dependent defaults
    (channels_last, cudnn_benchmark) filled in, so equal runs hash equal. A run does this in
    make_plan (execute), on the techniques it parsed once."""
    chosen = parse_techniques(config.techniques)
    config.techniques = applied(chosen)
    resolve_run_settings(config, chosen)  # before the device's defaults fill what is still unset
    config.train.resolve_tuning()
    return config


def config_hash(config: RunConfig) -> str:
    """The hash a run of `config` is recorded under (techniques in canonical form, run settings
    resolved): grids, maxres probes and tune trials find their records by it."""
    return resolved(copy.deepcopy(config)).hash()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def execute(config: RunConfig, db: ResultsDB | None,
            progress: Callable[[str], None] | None = None,
            checked: Checked | None = None) -> RunRecord:
    """`checked`: techniques.check_early's result for `config`, where the caller ran it (the
    CLI): the config is then neither checked nor parsed again."""
    name = run_name(config)
    plan = make_plan(config, checked=checked)  # raises ConfigError: nothing recorded
    prepare_process(plan)  # allocator settings, before anything initialises CUDA
    share_cpu_threads()  # recorded in env (num_threads)
    check_diagnosis_files()  # raises ConfigError: nothing recorded
    plan.device = rank_device(plan.device)  # distributed: each rank trains on its own GPU
    config.techniques = plan.applied()  # canonical form (make_plan resolved the run settings)
    train_set, val_set = build_datasets(  # raises on bad data and refused sizes
        config.data, config.train.image_size, config.train.batch_size, min_side(config.train),
        task=config.train.task, classes=config.model.classes)
    check_measurable(config, len(train_set), plan.chosen)  # raises ConfigError: nothing recorded
    device = plan.device
    # before anything touches the GPU: the CUDA context is measured as it is created
    limit = plan.budget_bytes
    budget_facts = apply_budget(limit, device, parameter_floor(plan) if limit is not None else 0)
    record = RunRecord(config=config.to_dict(), config_hash=config.hash(), name=name, status="ok",
                       env=envinfo.describe(device), started_at=time.time(), label=config.label)
    record.env["seed"] = config.train.seed
    record.env["data"] = describe_datasets(train_set, val_set)
    record.env.update(budget_facts)
    if device.type == "cuda":  # what the caching allocator runs with (`allocator`, or inherited)
        record.env.update(cuda_allocator.describe())
    seed_everything(config.train.seed)
    state, recorder, build, energy = TrainState(), None, None, None
    try:
        build = build_pipeline(plan)
        record.env["parameters"] = sum(p.numel() for p in build.model.parameters())
        cpu_limit = limit if device.type == "cpu" else None
        recorder = PhaseRecorder(device, build.model, build.runtime, lambda: state.optimizer,
                                 config.meter, cpu_limit_bytes=cpu_limit,
                                 single_process=config.world_size == 1)
        build.runtime.memory_meter = recorder.budget_meter
        _recap_budget_after_warmup(build, record.env)
        energy = EnergyCounter.open(device)  # None on the CPU: energy_j is then absent
        if energy is not None:
            energy.start()
        train(build, train_set, val_set, recorder, state, progress)
    except PhaseFailure as failure:
        oom = isinstance(failure.cause, torch.OutOfMemoryError)
        record.status, record.failed_phase = ("oom" if oom else "error"), failure.phase
        record.error = _describe(failure.cause)
    except Diverged as div:
        record.status, record.failed_phase, record.error = "diverged", div.phase, str(div)
    except torch.OutOfMemoryError as exc:
        record.status, record.failed_phase, record.error = "oom", "setup", _describe(exc)
    except Exception as exc:  # noqa: BLE001 - recorded, then reported by the caller
        record.status, record.failed_phase, record.error = "error", "setup", _describe(exc)
    finally:
        if recorder is not None:
            recorder.close()
        if energy is not None:  # the training loop's energy, validation included
            state.energy_j = energy.joules()
    _fill(record, recorder, state, plan, train_set.shapes)
    if device.type == "cuda":
        _read_back_allocator(record, device)
    if build is not None:  # rows recorded by techniques (e.g. tri_accel's control steps)
        record.series = [*record.series, *(r for src in build.runtime.series_sources for r in src())]
        record.env["notes"] = build.notes  # how techniques ran; the store writes it as JSON
    record = gather_record(record)  # distributed: rank 0 merges every rank's measurements
    # from the losses the loop read anyway: no sync was added to any step (memstudy.did_train)
    record.trained = judge(loss_ranges(record.series).values())
    if db is not None:
        db.record(record)
    _release(device)
    return record


def parameter_floor(plan) -> int:
    """Bytes of the model's parameters as every run holds them (fp32, the plain network), or 0
    when a technique of the plan changes or shards the parameters (their size is then known
    only once built). Counted on a model built under the meta device (what smp still makes
    on the CPU is a few small tensors, freed at once)."""
    from memstudy.models import build_model
    from memstudy.techniques.base import Stage  # the registry: above budget.py's layer

    reshaped = [n for n, t in plan.techniques.items() if n in plan.chosen and t.stage <= Stage.STRUCTURE
                and t.stage != Stage.PROCESS]
    if reshaped or plan.declaring("splits_model") or plan.declaring("contiguous_weights"):
        return 0
    with torch.device("meta"):
        model = build_model(plan.config, weights=False)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _recap_budget_after_warmup(build, env: dict) -> None:
    """Once the last warm-up step is done, cap the allocator by the context as it has grown."""
    last_warmup, limit = build.config.train.warmup_steps, build.plan.budget_bytes
    if limit is None or last_warmup < 1:  # on the CPU recap_after_warmup does nothing
        return

    def hook(info) -> None:
        if info.step == last_warmup:
            try:
                env.update(recap_after_warmup(limit, build.device))
            except Exception as exc:  # noqa: BLE001 - recorded with where it happened
                # after the last warm-up step's optimizer step, before the first measured
                # step: the step phase of that step, not the run's setup
                raise PhaseFailure(STEP, info.step, exc) from exc

    build.runtime.step_hooks.append(hook)


def share_cpu_threads() -> None:
    """A grid cell beside others takes the CPU threads the grid gave it (CELL_THREADS_ENV:
    grid.scheduler.cell_threads); elsewhere torch's default stays."""
    text = os.environ.get(CELL_THREADS_ENV)
    if text is None:
        return
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{CELL_THREADS_ENV}={text!r} must be a positive number of CPU "
                          "threads; unset it to use torch's default")
    torch.set_num_threads(int(text))


def _fill(record: RunRecord, recorder: PhaseRecorder | None, state: TrainState,
          plan, shapes: list[tuple[int, int]]) -> None:
    config = plan.config
    record.finished_at = time.time()
    record.epochs = state.epochs
    record.series = state.series
    if recorder is None:
        return
    summary = recorder.summary()
    run = summary.setdefault("run", {})
    run["steps"] = state.step
    limit = plan.budget_bytes
    if "nvml_peak_total_bytes" in run:
        run["nvml_process_peak_bytes"] = (run["nvml_peak_total_bytes"]
                                          - record.env.get("nvml_baseline_bytes", 0))
        if limit is not None:  # negative: the device went over
            run["budget_headroom_bytes"] = limit - run["nvml_process_peak_bytes"]
    run["oom_retries"] = state.oom_retries
    if state.energy_j is not None:
        run["energy_j"] = state.energy_j
    if state.target_reached is not None:
        run["time_to_target_s"], run["steps_to_target"] = state.target_reached
    batch = config.train.batch_size * _micro_batches(state.series)  # images per optimizer step
    run.update(pixel_count(shapes).figures(batch))  # real pixels, and the padding's overhead
    if "step_time_s" in run:
        run["throughput_px_s"] = run["real_px_per_step"] / run["step_time_s"]  # real pixels only
        try:  # a derived figure: failing to count must not lose the run's own record
            flops = _mean_flops(batch, shapes)
        except Exception as exc:  # noqa: BLE001 - kept in the record instead
            record.env["model_flops_error"] = _describe(exc)
        else:
            run["model_flops_per_step"] = flops
            run["model_tflops_s"] = flops / run["step_time_s"] / 1e12
    # a technique of the run compiles the model in its first step (declared fact)
    if plan.declaring("compiles") and "first_step_time_s" in run and "step_time_s" in run:
        run["compile_time_s"] = run["first_step_time_s"] - run["step_time_s"]
    record.metrics = [(0, phase, k, v) for phase, figs in summary.items() for k, v in figs.items()]


def _micro_batches(series: list[tuple[int, int, str, float]]) -> int:
    """Micro-batches per optimizer step: the median of the loop's `micro_batches` series
    (gradient accumulation; adaptive k varies), else 1."""
    counts = sorted(v for _, _, name, v in series if name == "micro_batches")
    return int(counts[len(counts) // 2]) if counts else 1


def _mean_flops(batch: int, shapes: list[tuple[int, int]]) -> float:
    """Model FLOPs per step (padded size) averaged over the training images' shapes."""
    counts = Counter((h if h == w else (h, w)) for h, w in shapes)
    return sum(n * model_flops_per_step(batch, size) for size, n in counts.items()) / len(shapes)


def _read_back_allocator(record: RunRecord, device: torch.device) -> None:
    """Compare what the allocator reports with the settings recorded for it (a derived record:
    failing to read it must not lose the run's own)."""
    try:
        facts = cuda_allocator.read_back(record.env.get("allocator_settings", ""), device)
    except Exception as exc:  # noqa: BLE001 - kept in the record instead
        record.env["allocator_read_back_error"] = _describe(exc)
        return
    record.env.update(facts)
    if facts.get("allocator_verified") is False:
        eprint(f"allocator: the CUDA allocator reports other settings than "
               f"{record.env.get('allocator_settings')!r}: {facts['allocator_mismatch']}")


def _describe(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)[-3:]
    where = "; ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in tb)
    return f"{type(exc).__name__}: {exc} [{where}]"


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


