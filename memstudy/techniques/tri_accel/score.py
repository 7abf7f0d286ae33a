"""What reports need from Tri-Accel runs: the per-control-step rows and the efficiency score.

Efficiency score ([Tri-Accel] (docs/references.md) section 4.2, with validation MS-SSIM as the quality):

    score = Q / (T * M) * 100
    Q = 100 * (1 - val_loss)        validation MS-SSIM in percent, last epoch
    T = time per epoch in s          mean `time_s` over epochs after the first (the first
                                     holds cuDNN autotuning and allocator warm-up); the only
                                     epoch when there is one. Training steps only: validation
                                     is not included; controller work (curvature) is.
    M = 100 * peak / capacity        peak: `run/alloc_peak_total_bytes` (allocator peak over
                                     measured steps, GPU); on the CPU the tensor meter's
                                     max over phases of start + peak (an upper bound).
                                     capacity: the run's budget, else the GPU's total memory.
docs/triaccel.md repeats this definition.
"""
from __future__ import annotations

from typing import Any

from memstudy.store import ResultsDB
from memstudy.techniques.tri_accel.precision import LEVELS


def efficiency_score(quality_pct: float, time_per_epoch_s: float, memory_pct: float) -> float:
    """Q / (T * M) * 100 (higher is better); see the module docstring for Q, T and M."""
    return quality_pct / (time_per_epoch_s * memory_pct) * 100


def control_rows(db: ResultsDB, run_id: int) -> list[dict[str, Any]]:
    """Per control step: {step, name, unit, value} for precision (with `level`: fp16 / bf16 /
    fp32), grad_var, eig<i>, lambda_max, lr (per unit) and mem_used_bytes, mem_capacity_bytes,
    batch_next, oom_at_batch, curvature_oom (unit None); plus the loop's per-step batch_size."""
    out = []
    for r in db.series(run_id, "tri/%"):
        kind, _, unit = r["name"][len("tri/"):].partition("/")
        row = {"step": r["step"], "name": kind, "unit": unit or None, "value": r["value"]}
        if kind == "precision":
            row["level"] = LEVELS[int(r["value"])]
        out.append(row)
    out += [{"step": r["step"], "name": "batch_size", "unit": None, "value": r["value"]}
            for r in db.series(run_id, "batch_size")]
    return sorted(out, key=lambda r: (r["step"], r["name"], r["unit"] or ""))


def run_efficiency(db: ResultsDB, run_id: int) -> dict[str, float | None]:
    """Q, T, peak bytes, capacity, M and the score of one stored run (None where missing)."""
    (run,) = db.query("SELECT * FROM runs WHERE id = ?", (run_id,))
    env = _json(run["env_json"])
    epochs = db.epochs(run_id)
    metrics = db.metrics(run_id)
    val = [e["val_loss"] for e in epochs if e["val_loss"] is not None]
    times = [e["time_s"] for e in epochs]
    quality = 100 * (1 - val[-1]) if val else None
    t_epoch = (sum(times[1:]) / len(times[1:]) if len(times) > 1 else times[0]) if times else None
    peak = _peak_bytes(metrics)
    capacity = env.get("budget_bytes") or env.get("gpu_total_bytes")
    mem_pct = 100 * peak / capacity if peak and capacity else None
    score = (efficiency_score(quality, t_epoch, mem_pct)
             if None not in (quality, t_epoch, mem_pct) else None)
    return {"quality_pct": quality, "time_per_epoch_s": t_epoch, "peak_bytes": peak,
            "capacity_bytes": capacity, "memory_pct": mem_pct, "score": score}


def _peak_bytes(metrics: dict[tuple[int, str], dict[str, float]]) -> float | None:
    run = metrics.get((0, "run"), {})
    if run.get("alloc_peak_total_bytes"):
        return run["alloc_peak_total_bytes"]
    tensor = [m["tensor_start_bytes"] + m["tensor_peak_bytes"] for (rank, _), m in metrics.items()
              if rank == 0 and "tensor_peak_bytes" in m]
    return max(tensor) if tensor else None


def _json(text: str) -> dict[str, Any]:
    import json

    return json.loads(text)
