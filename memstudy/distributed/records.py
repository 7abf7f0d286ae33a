"""Per-rank measurements of a distributed run, merged into the one run rank 0 stores.

Every rank measures its own forward / backward / step phases. Rank 0 gathers every rank's
RunRecord and stores ONE run whose metrics hold:
  rank r >= 0        what rank r measured;
  rank -1 (RANK_MEAN) the mean over ranks (the per-GPU average the study reports);
  rank -2 (RANK_MAX)  the maximum over ranks (what decides whether a run fits a GPU).
Epochs and series keep one row per rank. The run's status is rank 0's unless another rank
failed, in which case the first failing rank's status, phase and error (prefixed with
"rank r:") are stored.
"""
from __future__ import annotations

import copy
import statistics

import torch.distributed as dist

from memstudy.distributed.context import RANK_MAX, RANK_MEAN, is_distributed, rank, world_size

_OBJECT_GROUP = None  # gloo group for gathering records: survives a failed NCCL collective


def set_object_group(group) -> None:
    global _OBJECT_GROUP
    _OBJECT_GROUP = group


def gather_record(record):
    """Rank 0 returns the merged run; other ranks return their own record unchanged."""
    if not is_distributed() or world_size() == 1:
        return record
    gathered = [None] * world_size() if rank() == 0 else None
    dist.gather_object(record, gathered, dst=0, group=_OBJECT_GROUP)
    return merge(gathered) if rank() == 0 else record


def merge(records: list) -> object:
    merged = copy.copy(records[0])
    merged.metrics = _merge_metrics([r.metrics for r in records])
    merged.epochs = [dict(e, rank=r) for r, rec in enumerate(records) for e in rec.epochs]
    merged.series = [(r, s, n, v) for r, rec in enumerate(records) for _, s, n, v in rec.series]
    merged.env = dict(records[0].env)
    merged.env["ranks"] = [{"rank": r, "device": str(rec.env.get("device")),
                            "gpu_name": rec.env.get("gpu_name"),
                            "parameters": rec.env.get("parameters")}
                           for r, rec in enumerate(records)]
    for r, rec in enumerate(records):
        if rec.status != "ok":
            merged.status, merged.failed_phase = rec.status, rec.failed_phase
            merged.error = f"rank {r}: {rec.error}"
            break
    merged.finished_at = max(r.finished_at for r in records)
    return merged


def _merge_metrics(per_rank: list[list[tuple]]) -> list[tuple]:
    rows, by_key = [], {}
    for r, metrics in enumerate(per_rank):
        for _, phase, name, value in metrics:
            rows.append((r, phase, name, value))
            if value is not None:
                by_key.setdefault((phase, name), []).append(value)
    for (phase, name), values in by_key.items():
        rows.append((RANK_MEAN, phase, name, statistics.fmean(values)))
        rows.append((RANK_MAX, phase, name, max(values)))
    return rows
