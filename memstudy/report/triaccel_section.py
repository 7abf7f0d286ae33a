"""The report's Tri-Accel section: efficiency scores and per-control-step series.

Shown only when the database holds runs with the `tri_accel` technique. The score and the
control rows come from memstudy.techniques.tri_accel.score (one definition, docs/triaccel.md);
that module needs torch, so it is imported here only once such runs are found: `import
memstudy.report` and reports of databases without Tri-Accel runs stay torch-free.
"""
from __future__ import annotations

from typing import Any

from memstudy.report.data import load_runs, open_db
from memstudy.byte_sizes import mb
from memstudy.image_sizes import size_sort_key

TECHNIQUE = "tri_accel"
Rows = list[dict[str, Any]]
# Network order of the units (memstudy.techniques.tri_accel.control_units) for plots; unknown
# names go last.
UNIT_ORDER = ("stem", "encoder", "decoder", "head")


def is_tri(run: dict[str, Any]) -> bool:
    return any(str(t).split(":")[0] == TECHNIQUE for t in run["config"].get("techniques", []))


def tri_runs(db) -> Rows:
    """Runs of the database that use tri_accel and finished, in the order they were stored."""
    return [r for r in load_runs(db) if is_tri(r) and r["status"] == "ok"]


def efficiency(db) -> Rows:
    """The efficiency table: every finished run of the database (the non-Tri-Accel ones are
    the baselines) with Q (val MS-SSIM %), T (s/epoch), peak MB, M (memory %) and the score;
    [] when no run uses tri_accel."""
    db = open_db(db)
    runs = [r for r in load_runs(db) if r["status"] == "ok"]
    if not any(is_tri(r) for r in runs):
        return []
    # torch: only for Tri-Accel databases
    from memstudy.techniques.tri_accel.score import run_efficiency

    rows = []
    for r in runs:
        e = run_efficiency(db, r["id"])
        rows.append({"name": r["name"], "image_size": r["image_size"], "run": r["id"],
                     "tri_accel": is_tri(r), "quality_pct": e["quality_pct"],
                     "time_per_epoch_s": e["time_per_epoch_s"], "peak_mb": mb(e["peak_bytes"]),
                     "capacity_mb": mb(e["capacity_bytes"]), "memory_pct": e["memory_pct"],
                     "score": e["score"]})
    return sorted(rows, key=lambda x: (size_sort_key(x["image_size"]), x["run"]))


def control_series(db, run_id: int) -> dict[str, Any]:
    """One run's control steps arranged for plotting: `units` in network order, `levels`
    (precision tier names by index) and, per
    kind, {unit: [(step, value)]} for precision / lambda_max / lr, [(step, value)] for
    batch_size (every step), batch_next, mem_used_mb, mem_capacity_mb."""
    from memstudy.techniques.tri_accel.score import control_rows
    from memstudy.techniques.tri_accel.precision import LEVELS

    out: dict[str, Any] = {k: {} for k in ("precision", "lambda_max", "lr")}
    out["levels"] = list(LEVELS)
    out.update({k: [] for k in ("batch_size", "batch_next", "mem_used_mb", "mem_capacity_mb")})
    for row in control_rows(open_db(db), run_id):
        kind, value = row["name"], row["value"]
        if kind in ("precision", "lambda_max", "lr"):
            out[kind].setdefault(row["unit"], []).append((row["step"], value))
        elif kind in ("batch_size", "batch_next"):
            out[kind].append((row["step"], value))
        elif kind in ("mem_used_bytes", "mem_capacity_bytes"):
            out[kind.replace("_bytes", "_mb")].append((row["step"], mb(value)))
    units = {u for k in ("precision", "lambda_max", "lr") for u in out[k]}
    out["units"] = sorted(units, key=_unit_key)
    return out


def _unit_key(unit: str) -> tuple[int, str]:
    prefix = unit.split(".")[0]
    return (UNIT_ORDER.index(prefix) if prefix in UNIT_ORDER else len(UNIT_ORDER), unit)
