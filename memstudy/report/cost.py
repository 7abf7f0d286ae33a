"""[Compute-Opt] (docs/references.md)'s cost objective (eq. 3) and throughput/memory-optimal accumulation (eq. 9).

Cost (docs/metrics.md, "Cost objective"): C = w1 T + w2 M + w3 E per finished run, lower is
better, each figure normalised by the best (smallest) value among the runs compared with it
(same image size and device), so C is dimensionless and the best run on every figure scores
w1 + w2 + w3:
  T  run/time_to_target_s   wall time from the first step to the first validation at or below
                            train.target_val_loss (absent if never reached)
  M  the run's absolute peak memory (report.data `peaks`: allocator + CUDA context on a GPU,
     live tensor bytes on the CPU), the figure a memory budget caps
  E  run/energy_j           NVML energy of the training loop (absent on the CPU)
A run missing a figure whose weight is not zero gets no C (it is not silently dropped from
the objective); a run that did not train (memstudy.did_train) gets no row. Weights come from `memstudy report --cost-weights w1,w2,w3` (default 1,1,1).

Accumulation (eq. 9): k_optimal = argmax_k Throughput(k) / Memory(k) among measured runs of
one effective batch B_eff = batch_size x k (same size, device and other techniques);
Throughput = run/throughput_px_s, Memory = the same absolute peak as M. Runs without the
technique are k = 1; adaptive-k runs are left out (their k changes from step to step).
Torch-free, like the rest of memstudy.report.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from memstudy.byte_sizes import mb
from memstudy.errors import ConfigError
from memstudy.report.data import device_of, did_not_train, load_runs
from memstudy.report.experiments import experiment
from memstudy.image_sizes import size_sort_key

Rows = list[dict[str, Any]]
DEFAULT_WEIGHTS = (1.0, 1.0, 1.0)
TECHNIQUE = "accumulate"

COLUMNS = {
    "cost": [("name", "techniques"), ("image_size", "px"), ("batch_size", "batch"),
             ("device", "device"), ("run", "run"), ("time_to_target_s", "T: s to target"),
             ("peak_mb", "M: peak MB"), ("energy_j", "E: J"), ("t_norm", "T/best"),
             ("m_norm", "M/best"), ("e_norm", "E/best"), ("cost", "C")],
    "accumulation": [("others", "other techniques"), ("image_size", "px"),
                     ("effective_batch", "B_eff"), ("device", "device"), ("k", "k"),
                     ("batch_size", "micro-batch"), ("throughput_px_s", "px/s"),
                     ("peak_mb", "peak MB"), ("px_s_per_mb", "px/s per MB"),
                     ("optimal", "k_optimal")],
}
TITLES = {
    "cost": "Cost objective C = w1 T + w2 M + w3 E ([Compute-Opt] eq. 3; each figure over the best "
            "run at its size and device; lower is better; docs/metrics.md)",
    "accumulation": "Gradient accumulation: throughput / memory per k at one effective batch "
                    "([Compute-Opt] eq. 9; the largest ratio is k_optimal)",
}


def parse_weights(text: str) -> tuple[float, float, float]:
    """"w1,w2,w3" -> three weights >= 0, not all zero (ConfigError naming the option)."""
    try:
        weights = tuple(float(w) for w in text.split(","))
    except ValueError:
        raise ConfigError(f"--cost-weights {text!r}: write three numbers, e.g. 1,1,0") from None
    if len(weights) != 3 or min(weights) < 0 or not any(weights):
        raise ConfigError(f"--cost-weights {text!r}: three weights >= 0 (w1 time, w2 memory, "
                         "w3 energy), not all zero")
    return weights  # type: ignore[return-value]


def cost(db, weights: tuple[float, float, float] = DEFAULT_WEIGHTS) -> Rows:
    """Eq. 3 for every finished run (see the module docstring for T, M, E and the norm)."""
    # a run that did not train reaches no target: it is not a working set to weigh
    rows = [_figures(r) for r in load_runs(db) if r["status"] == "ok" and not did_not_train(r)]
    groups: dict[tuple, Rows] = defaultdict(list)
    for row in rows:
        groups[(row["image_size"], row["device"])].append(row)
    for group in groups.values():
        for figure, norm in (("time_to_target_s", "t_norm"), ("peak_bytes", "m_norm"),
                             ("energy_j", "e_norm")):
            best = min((r[figure] for r in group if r[figure]), default=None)
            for r in group:
                r[norm] = r[figure] / best if r[figure] and best else None
    for row in rows:
        row["cost"] = objective(weights, (row["t_norm"], row["m_norm"], row["e_norm"]))
    return sorted(rows, key=lambda r: (r["device"], size_sort_key(r["image_size"]), r["run"]))


def objective(weights: tuple[float, float, float], normed: tuple) -> float | None:
    """w1 T + w2 M + w3 E over the normalised figures; None if a weighted figure is missing."""
    if any(w and v is None for w, v in zip(weights, normed)):
        return None
    return sum(w * v for w, v in zip(weights, normed) if w)


def accumulation(db) -> Rows:
    """Eq. 9 table: one row per run of a group with an accumulate run, k_optimal marked."""
    groups: dict[tuple, Rows] = defaultdict(list)
    for r in load_runs(db):
        k = _fixed_k(r["config"].get("techniques", []))
        if r["status"] != "ok" or k is None:
            continue
        run = r["metrics"].get("run", {})
        peak = max(r["peaks"].values(), default=None)
        others = "+".join(t.split(":")[0] for t in r["config"]["techniques"]
                          if t.split(":")[0] != TECHNIQUE) or "original"
        row = {"others": others, "image_size": r["image_size"], "device": device_of(r),
               "effective_batch": r["batch_size"] * k, "k": k, "batch_size": r["batch_size"],
               "throughput_px_s": run.get("throughput_px_s"), "peak_mb": mb(peak),
               "run": r["id"], "accumulates": k > 1}
        row["px_s_per_mb"] = (row["throughput_px_s"] / row["peak_mb"]
                              if row["throughput_px_s"] and row["peak_mb"] else None)
        # k is compared within one experiment but for the micro-batch (report.experiments)
        same = experiment(r, ("train.batch_size",))[1:]
        groups[(others, r["image_size"], row["effective_batch"], same)].append(row)
    out = []
    for group in groups.values():
        if not any(r["accumulates"] for r in group):
            continue
        scored = [r for r in group if r["px_s_per_mb"] is not None]
        best = max(scored, key=lambda r: r["px_s_per_mb"], default=None)
        for r in sorted(group, key=lambda r: r["k"]):
            r["optimal"] = "<- k_optimal" if r is best else ""
            out.append(r)
    return out


def _fixed_k(techniques: list[str]) -> int | None:
    """k of a run's accumulate technique (1 without it); None for adaptive k."""
    for spec in techniques:
        name, *opts = spec.split(":")
        if name != TECHNIQUE:
            continue
        values = dict(o.split("=", 1) for o in opts if "=" in o)
        if values.get("mode", "fixed") != "fixed":
            return None
        positional = [o for o in opts if "=" not in o]
        return int(values.get("k", positional[0] if positional else 2))
    return 1


def _figures(r: dict[str, Any]) -> dict[str, Any]:
    run = r["metrics"].get("run", {})
    peak = max(r["peaks"].values(), default=None)
    return {"name": r["name"], "image_size": r["image_size"], "batch_size": r["batch_size"],
            "device": device_of(r), "run": r["id"], "time_to_target_s": run.get("time_to_target_s"),
            "peak_bytes": peak, "peak_mb": mb(peak), "energy_j": run.get("energy_j")}

