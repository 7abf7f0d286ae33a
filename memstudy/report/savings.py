"""What the runs answer without a budget: the memory each technique set acts on.

The decision (report.decide) needs a budget: it ranks the sets whose absolute peak fits one.
A database without a budgeted run, searched size or `--budget` has none, and at small sizes
(the CPU quick study: 192 and 256 px) every set's absolute peak is the model state's (the
parameters, their gradients and Adam's two moments: four times the parameters) plus a few MB,
so absolute peaks cannot tell the sets apart. What the runs do measure is the
activation memory a technique saves or spends: the tensors held for backward at the forward's
end (categories, docs/metrics.md) and the largest phase increment (the study's per-phase
figure), each against original's at the same size and settings. Those grow with the pixels
while the model state does not, which is what a budget at a large size decides on.

Table `savings` (one row per experiment, report.experiments): saved MB, x original, largest
increment MB, x original, absolute peak MB, model state MB, step s, x original, n.
Torch-free, like the rest of memstudy.report.
"""
from __future__ import annotations

import math
from typing import Any

from memstudy.byte_sizes import mb
from memstudy.report.data import TRAIN_PHASES, phase_peak, step_time
from memstudy.report.decide import BASELINE, _row_order, phase_groups
from memstudy.report.tables import DIFFERS, spread
from memstudy.image_sizes import size_hw, size_sort_key

Rows = list[dict[str, Any]]
SAVED = ("cat_saved_bytes", "cat_loss_saved_bytes")  # held for backward at the forward's end
MODEL_STATE = ("cat_params_bytes", "cat_grads_bytes", "cat_optimizer_bytes")


def needs(rows: Rows, db_path: str) -> str:
    """The decision's line without a budget: what it needs, with a budget that would split
    these runs (suggest_budget), and where the answer the runs do give is."""
    budget = suggest_budget(rows)
    example = f" --budget {budget}" if budget else " --budget 8GiB"
    return (f"no budget in these runs nor given, so no set can be ranked by what fits (memstudy "
            f"report {db_path}{example}, or a budget in the grid spec); what the runs answer without "
            "one: the activation memory of each set, below")


def suggest_budget(rows: Rows) -> str | None:
    """A budget that splits the sets at the largest size measured: the median absolute peak
    there, floored to two significant digits of MiB (a peak exactly at it does not fit)."""
    sized = [r for r in rows if r["peak_mb"] and size_hw(r["image_size"])]
    if not sized:
        return None
    largest = max(size_sort_key(r["image_size"]) for r in sized)
    peaks = sorted(r["peak_mb"] for r in sized if size_sort_key(r["image_size"]) == largest)
    middle = peaks[len(peaks) // 2]
    unit = 10 ** max(int(math.log10(middle)) - 1, 0)
    return f"{int(middle // unit * unit)}MiB"


def savings(db) -> Rows:
    """Per experiment: its activation memory and time beside original's (module docstring)."""
    rows = [_row(key, runs) for key, runs in phase_groups(db).items()]
    base = {_same(r): r for r in rows if r["name"] == BASELINE}
    for row in rows:
        b = base.get(_same(row))
        for key in ("saved_mb", "increment_mb", "step_time_s"):
            row[f"{key}_x"] = _ratio(row[key], b[key]) if b else None
    return sorted(rows, key=_row_order)


def _row(key: tuple, runs: Rows) -> dict[str, Any]:
    name, size, batch, device, _label, differs, same = key
    forward = [r["metrics"].get("forward", {}) for r in runs]
    saved = [sum(m[k] for k in SAVED if k in m) if SAVED[0] in m else None for m in forward]
    increments = [max((phase_peak(r["metrics"].get(p, {})) or 0.0 for p in TRAIN_PHASES),
                      default=None) for r in runs]
    state = [max((sum(r["metrics"].get(p, {}).get(k, 0.0) for k in MODEL_STATE)
                  for p in TRAIN_PHASES), default=None) for r in runs]
    return {"name": name, "image_size": size, "batch_size": batch, "device": device,
            "differs": differs, "comparison": same, "runs": len(runs),
            "saved_mb": mb(spread(saved)[0]), "increment_mb": mb(spread(increments)[0]),
            "peak_mb": mb(spread([max(r["peaks"].values(), default=None) for r in runs])[0]),
            "state_mb": mb(spread(state)[0]) or None,
            "step_time_s": spread([step_time(r) for r in runs])[0]}


def _same(row: dict[str, Any]) -> tuple:
    return row["image_size"], row["batch_size"], row["device"], row["comparison"]


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


COLUMNS = {"savings": [
    ("name", "techniques"), ("image_size", "px"), ("device", "device"),
    ("saved_mb", "saved for backward MB"), ("saved_mb_x", "x original"),
    ("increment_mb", "largest phase + MB"), ("increment_mb_x", "x original"),
    ("peak_mb", "absolute peak MB"), ("state_mb", "model state MB"),
    ("step_time_s", "step s"), ("step_time_s_x", "x original"), ("runs", "n"),
    ("differs", DIFFERS)]}
TITLES = {"savings": "Activation memory per set: held for backward at the forward's end and "
                     "the largest phase increment, against original (docs/report.md)"}
