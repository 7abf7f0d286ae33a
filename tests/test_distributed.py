"""Validation of distributed configurations (no process started) and the per-rank merge.

Plans are made as on the lead's 2-GPU host (device cuda, 2 GPUs) without touching a GPU:
every combination of the study's Tables 3-6 must be accepted, and impossible ones refused
with a message naming the setting.
"""
from __future__ import annotations

import pytest
import torch

from conftest import small_config
from memstudy.distributed import RANK_MAX, RANK_MEAN
from memstudy.distributed.records import merge
from memstudy.errors import ConfigError
from memstudy.store import RunRecord
from memstudy.techniques.base import Plan
from memstudy.techniques.compose import make_plan

TABLE_4 = ["dp", "dp,amp", "dp,zero", "dp,zero,amp", "dp,zero,checkpoint", "dp,zero,invertible",
           "dp,zero,amp,checkpoint"]
TABLE_6 = ["mp", "mp,amp", "mp,checkpoint", "mp,invertible", "mp,amp,checkpoint",
           "mp,amp,invertible", "mp,amp,checkpoint,invertible"]


def plan_for(techniques: str, world_size: int = 2, device: str = "cuda", n_gpus: int = 2,
             batch_size: int = 2, warmup_steps: int = 2) -> Plan:
    """make_plan's checks, with the device given instead of probed."""
    cfg = small_config(techniques=techniques.split(","), batch_size=batch_size,
                       warmup_steps=warmup_steps)
    cfg.world_size = world_size
    cfg.train.device = device
    return make_plan(cfg, device=torch.device(device), n_gpus=n_gpus)


@pytest.mark.parametrize("techniques", TABLE_4 + TABLE_6)
def test_study_combinations_are_accepted(techniques):
    plan_for(techniques)


@pytest.mark.parametrize("techniques", [t.replace("mp", "mp:mode=local", 1) for t in TABLE_6])
def test_study_mp_combinations_in_one_process_on_two_gpus(techniques):
    plan_for(techniques, world_size=1)


def test_split_applies_after_other_structural_techniques():
    plan = plan_for("mp,invertible,checkpoint")
    assert list(plan.chosen)[:2] == ["invertible", "mp"]


@pytest.mark.parametrize("techniques, kwargs, words", [
    ("mp:mode=local", dict(world_size=1, n_gpus=1), ["mp:mode=process", "GPU"]),
    ("mp:mode=local", dict(world_size=1, device="cpu", n_gpus=0), ["two GPUs"]),
    ("mp", dict(world_size=3, n_gpus=3), ["world_size = 2"]),
    ("mp", dict(world_size=1), ["world_size"]),
    ("dp", dict(world_size=1), ["world_size >= 2"]),
    ("dp", dict(warmup_steps=1), ["train.warmup_steps"]),
    ("dp", dict(batch_size=3), ["train.batch_size 3", "world_size 2"]),
    ("fsdp", dict(batch_size=5), ["train.batch_size 5"]),
    ("dp:backend=nccl", dict(device="cpu", n_gpus=0), ["backend=nccl", "gloo"]),
    ("mp:backend=gloo", dict(), ["backend=nccl"]),
    ("zero", dict(), ["needs dp"]),
    ("dp,zero,fsdp", dict(), ["drop"]),
    ("fsdp,zero", dict(), ["drop zero"]),
    ("dp,mp:mode=local", dict(world_size=1), ["mp:mode=local"]),
    ("dp,mp", dict(), ["drop one"]),
    ("mp,pipeline", dict(), ["mp and pipeline", "drop one"]),
    ("dp", dict(world_size=4, n_gpus=2), ["only 2 GPU"]),
    ("pipeline:micro_batches=3", dict(batch_size=4), ["micro_batches=3", "train.batch_size 4"]),
    ("mp,checkpoint:sqrt", dict(), ["checkpoint:block"]),
    ("pipeline:micro_batches=1", dict(), ["micro_batches must be >= 2"]),
])
def test_impossible_combinations_are_refused_by_name(techniques, kwargs, words):
    with pytest.raises(ConfigError) as err:
        plan_for(techniques, **kwargs)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_world_size_without_a_distributed_technique_is_refused():
    from memstudy.launch_ranks import group_backend

    cfg = small_config(techniques=[], batch_size=2, warmup_steps=2)
    cfg.world_size = 2
    with pytest.raises(ConfigError, match="no distributed technique"):
        group_backend(cfg)
    cfg.techniques = ["dp"]
    assert group_backend(cfg) == "gloo"  # the CPU: gloo


def _record(rank: int, fwd: float, status: str = "ok") -> RunRecord:
    return RunRecord(config={"train": {}}, config_hash="h", name="dp", status=status,
                     env={"device": f"cuda:{rank}"}, started_at=0.0, finished_at=float(rank),
                     error=None if status == "ok" else "OutOfMemoryError",
                     failed_phase=None if status == "ok" else "backward",
                     metrics=[(0, "forward", "alloc_peak_bytes", fwd), (0, "run", "steps", 2)],
                     epochs=[{"rank": 0, "epoch": 0, "steps": 2, "time_s": 1.0}],
                     series=[(0, 1, "loss", 0.5)])


def test_merge_keeps_each_rank_and_adds_mean_and_max():
    merged = merge([_record(0, 100.0), _record(1, 300.0)])
    rows = {(r, p, n): v for r, p, n, v in merged.metrics}
    assert rows[(0, "forward", "alloc_peak_bytes")] == 100.0
    assert rows[(1, "forward", "alloc_peak_bytes")] == 300.0
    assert rows[(RANK_MEAN, "forward", "alloc_peak_bytes")] == 200.0
    assert rows[(RANK_MAX, "forward", "alloc_peak_bytes")] == 300.0
    assert [e["rank"] for e in merged.epochs] == [0, 1]
    assert [s[0] for s in merged.series] == [0, 1]
    assert merged.status == "ok" and merged.finished_at == 1.0
    assert [r["device"] for r in merged.env["ranks"]] == ["cuda:0", "cuda:1"]


def test_merge_reports_the_first_failing_rank():
    merged = merge([_record(0, 1.0), _record(1, 1.0, status="oom")])
    assert (merged.status, merged.failed_phase) == ("oom", "backward")
    assert merged.error.startswith("rank 1:")
