"""The study's tables as lists of dict rows (pandas-free), computed from a results database.

A row is one experiment (memstudy.report.experiments): runs of one technique set, size,
batch and device that agree on every measured setting; repeated runs of it (seeds) are averaged
over the runs that finished ok, and `runs` says how many there were. Rows that share a set,
size, batch and device name what sets them apart in `differs`.
Memory is in MB (MiB, as torch and nvidia-smi count): a phase's peak above the memory held
when the phase began (allocator on CUDA, tensor meter on the CPU; docs/report.md).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean, stdev
from typing import Any

from memstudy.report.data import (PROBE_LABEL, TRAIN_PHASES, device_of, did_not_train, epoch_time,
                                  load_maxres, load_runs, phase_peak, step_time)
from memstudy.report.experiments import experiment, label_experiments, technique_set
from memstudy.image_sizes import size_sort_key
from memstudy.store import NOT_TRAINED, ResultsDB, describe_outcome
from memstudy.byte_sizes import mb

BASELINE = "original"
ACROSS_SIZES = ("train.image_size",)
Rows = list[dict[str, Any]]
DB = str | Path | ResultsDB


def spellings(runs: Rows) -> dict[str, list[str]]:
    """For each technique set recorded under more than one spelling: the spelling the tables
    show (the first recorded) -> every spelling recorded."""
    seen: dict[tuple, list[str]] = defaultdict(list)
    for run in runs:
        names = seen[technique_set(run)]
        if run["name"] not in names:
            names.append(run["name"])
    return {names[0]: names for names in seen.values() if len(names) > 1}


def _groups(runs: Rows) -> dict[tuple, Rows]:
    """Runs by experiment, keyed (name, size, batch, device, differs, comparison); a set is
    shown once, by its first spelling."""
    shown: dict[tuple, str] = {}
    groups: dict[tuple, Rows] = defaultdict(list)
    for run in runs:
        shown.setdefault(technique_set(run), run["name"])
        groups[experiment(run)].append(run)
    differs, comparison = label_experiments({k: g[0] for k, g in groups.items()})
    return {(shown[technique_set(g[0])], g[0]["image_size"], g[0]["batch_size"],
             device_of(g[0]), differs[k], comparison[k]): g for k, g in groups.items()}


def _avg(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return mean(present) if present else None


def spread(values: list[float | None]) -> tuple[float | None, float | None, int]:
    """(mean, sample std, n) of the values present; std is None for fewer than two (one seed
    has no spread)."""
    present = [v for v in values if v is not None]
    return _avg(present), (stdev(present) if len(present) > 1 else None), len(present)


def _spread_of(key: str, values: list[float | None]) -> dict[str, float | None]:
    avg, std, _n = spread(values)
    return {key: avg, f"{key}_std": std}


def _status(runs: Rows) -> str:
    """'ok', 'ok 2/3', 'ok, 1 did not train' (memstudy.did_train), or the last run's failure."""
    ok, dead = sum(r["status"] == "ok" for r in runs), sum(did_not_train(r) for r in runs)
    if ok:
        return ("ok" if ok == len(runs) else f"ok {ok}/{len(runs)}") + (
            f", {dead} {NOT_TRAINED}" if dead else "")
    last = runs[-1]
    return describe_outcome(last["status"], last["failed_phase"], last["trained"])


def _key(row: dict[str, Any]) -> tuple:
    # sizes of every stored form (256, "200x296", "native") in one order: by pixels, native last
    return (row["device"], size_sort_key(row["image_size"]), row["batch_size"],
            row["name"] != BASELINE, row["name"])


def phase_memory(db: DB, image_size: int | None = None) -> Rows:
    """Tables 2/4/6: forward / backward / step peak MB, peak total MB, time per step and epoch."""
    rows = []
    for (name, size, batch, device, differs, same), runs in _groups(load_runs(db)).items():
        if image_size is not None and size != image_size:
            continue
        ok = [r for r in runs if r["status"] == "ok"] or runs
        row = {"name": name, "image_size": size, "batch_size": batch, "device": device,
               "differs": differs, "comparison": same, "status": _status(runs),
               "runs": len(runs)}
        for phase in TRAIN_PHASES:
            row[f"{phase}_mb"] = mb(_avg([phase_peak(r["metrics"].get(phase, {})) for r in ok]))
        row["peak_total_mb"] = mb(_avg([max(r["peaks"].values(), default=None) for r in ok]))
        row.update(_spread_of("step_time_s", [step_time(r) for r in ok]))
        row["epoch_time_s"] = _avg([epoch_time(r) for r in ok])
        rows.append(row)
    return sorted(rows, key=_key)


def losses(db: DB, image_size: int | None = None) -> Rows:
    """Table 1: train and validation loss (1 - MS-SSIM) of the final epoch, SSIM and PSNR.

    Runs that did not train (memstudy.did_train) are counted in `not_trained`, never averaged
    in: their loss is the clamp's, not the technique set's; a group of only such runs shows
    no loss."""
    rows = []
    for (name, size, batch, device, differs, _same), runs in _groups(load_runs(db)).items():
        # runs without validation (memory grids) have no place in a loss table
        done = [r for r in runs if r["status"] == "ok" and r["last_epoch"]
                and r["last_epoch"].get("val_loss") is not None]
        if (image_size is not None and size != image_size) or not done:
            continue
        last = [r["last_epoch"] for r in done if not did_not_train(r)]
        rows.append({"name": name, "image_size": size, "batch_size": batch, "device": device,
                     "differs": differs, "epochs": max(r["last_epoch"]["epoch"] for r in done) + 1,
                     **_spread_of("train_loss", [e["train_loss"] for e in last]),
                     **_spread_of("val_loss", [e["val_loss"] for e in last]),
                     "val_ssim": _avg([e["val_ssim"] for e in last]),
                     "val_psnr": _avg([e["val_psnr"] for e in last]), "runs": len(last),
                     "not_trained": len(done) - len(last)})
    return sorted(rows, key=_key)


def memory_ratios(db: DB, baseline: str = BASELINE) -> Rows:
    """Fig. 2: each phase's peak MB divided by the baseline's at the same size, batch, device
    and settings (the `comparison` of memstudy.report.experiments)."""
    table = phase_memory(db)
    same = ("image_size", "batch_size", "device", "comparison")
    base = {tuple(r[k] for k in same): r for r in table
            if r["name"] == baseline and r["status"] == "ok"}
    rows = []
    for r in table:
        b = base.get(tuple(r[k] for k in same))
        if b is None or r["name"] == baseline or not r["status"].startswith("ok"):
            continue
        row = {k: r[k] for k in ("name", "image_size", "batch_size", "device", "differs")}
        for phase in TRAIN_PHASES:
            num, den = r[f"{phase}_mb"], b[f"{phase}_mb"]
            row[phase] = num / den if num is not None and den else None
        rows.append(row)
    return rows


def memory_vs_resolution(db: DB) -> Rows:
    """Absolute peak MB (what a budget caps) of every run by technique set and size, maxres
    probes included: a failed run keeps its status so plots can mark where it stopped."""
    runs = load_runs(db, probes=True)
    # a plotted line is one experiment across sizes; `differs` tells a set's lines apart
    lines = {experiment(r, ACROSS_SIZES): r for r in runs}
    differs, _same = label_experiments(lines, lambda r: (technique_set(r), device_of(r)),
                                       ACROSS_SIZES)
    rows = []
    for r in runs:
        peak = max(r["peaks"].values(), default=None)
        rows.append({"name": r["name"], "image_size": r["image_size"], "batch_size": r["batch_size"],
                     "device": device_of(r), "status": r["status"], "failed_phase": r["failed_phase"],
                     "peak_mb": mb(peak), "budget_mb": mb(r["env"].get("budget_bytes")),
                     "differs": differs[experiment(r, ACROSS_SIZES)]})
    return sorted(rows, key=lambda x: (x["device"], x["name"], size_sort_key(x["image_size"])))


def largest_size(db: DB) -> Rows:
    """The largest trainable size under a budget per technique set (memstudy maxres); one row
    per search (its settings: maxres's config_key), `differs` naming what sets apart searches
    of one set and budget (read from their probes' stored configs)."""
    results = load_maxres(db)
    probes = _probe_runs(db) if results else {}
    found = {r["id"]: probes[r["config_key"]] for r in results if r["config_key"] in probes}
    differs, _same = label_experiments(found, lambda p: (technique_set(p), p["config"].get(
        "budget"), p["batch_size"], device_of(p)), ACROSS_SIZES)
    return [{"name": r["name"], "budget": r["budget"], "device": r["gpu_name"] or r["device"],
             "batch_size": r["batch_size"], "predicted_px": r["predicted_px"],
             "found_px": r["found_px"], "peak_mb": mb(r["peak_bytes"]),
             "step_time_s": r["step_time_s"], "fit_phase": r["fit_phase"], "error": r["error"],
             "differs": differs.get(r["id"], "")}
            for r in results]


def _probe_runs(db: DB) -> dict[str, dict[str, Any]]:
    """One probe run per maxres config_key: the hash of its config at image size 0, as
    maxres.config_key makes it (a config an older memstudy stored that no longer loads: none)."""
    from memstudy.config import from_dict
    from memstudy.errors import ConfigError

    out: dict[str, dict[str, Any]] = {}
    for run in load_runs(db, probes=True):
        if run["label"] != PROBE_LABEL:
            continue
        try:
            cfg = from_dict(run["config"])
        except (ConfigError, TypeError):
            continue
        cfg.train.image_size = 0
        out.setdefault(cfg.hash(), run)
    return out


# Columns of each table for rendering: (row key, header). `differs` (memstudy.report.experiments)
# is left out of a table where no row needs it: no two of its rows share set, size and device.
DIFFERS = "settings that differ"
COLUMNS: dict[str, list[tuple[str, str]]] = {
    "phase_memory": [("name", "techniques"), ("image_size", "px"), ("batch_size", "batch"),
                     ("device", "device"), ("forward_mb", "Forward MB"), ("backward_mb", "Backward MB"),
                     ("step_mb", "Step MB"), ("peak_total_mb", "peak total MB"),
                     ("step_time_s", "step s"), ("epoch_time_s", "epoch s"), ("status", "status"),
                     ("runs", "runs"), ("differs", DIFFERS)],
    "losses": [("name", "techniques"), ("image_size", "px"), ("batch_size", "batch"),
               ("device", "device"), ("epochs", "epochs"), ("train_loss", "train loss"),
               ("val_loss", "val loss"), ("val_ssim", "val SSIM"), ("val_psnr", "val PSNR dB"),
               ("runs", "runs"), ("not_trained", NOT_TRAINED), ("differs", DIFFERS)],
    "memory_ratios": [("name", "techniques"), ("image_size", "px"), ("batch_size", "batch"),
                      ("device", "device"), ("forward", "Forward"), ("backward", "Backward"),
                      ("step", "Step"), ("differs", DIFFERS)],
    "largest_size": [("name", "techniques"), ("budget", "budget"), ("device", "device"),
                     ("batch_size", "batch"), ("predicted_px", "predicted px"),
                     ("found_px", "found px"), ("peak_mb", "peak MB"), ("step_time_s", "step s"),
                     ("error", "error"), ("differs", DIFFERS)],
    # not in TABLES: shown only for databases with Tri-Accel runs (memstudy.report.triaccel_section)
    "tri_efficiency": [("name", "techniques"), ("image_size", "px"), ("run", "run"),
                       ("quality_pct", "val MS-SSIM %"), ("time_per_epoch_s", "epoch s"),
                       ("peak_mb", "peak MB"), ("capacity_mb", "capacity MB"),
                       ("memory_pct", "memory %"), ("score", "score")],
}

TITLES = {"phase_memory": "Per-phase peak memory (MB above the phase's start) and time",
          "losses": "Loss (1 - MS-SSIM) of the final epoch, validation SSIM and PSNR (runs that "
                    "did not train counted apart, not averaged in; docs/metrics.md)",
          "memory_ratios": "Peak memory relative to original, per phase (smaller is better)",
          "largest_size": "Largest trainable square size under the budget",
          "tri_efficiency": "Tri-Accel efficiency score: val MS-SSIM % / (s per epoch x "
                            "memory %) x 100 (higher is better; docs/triaccel.md)"}

TABLES = {"phase_memory": phase_memory, "losses": losses, "memory_ratios": memory_ratios,
          "largest_size": largest_size}


PRECISION = {"train_loss": 4, "val_loss": 4, "val_ssim": 4, "val_psnr": 2, "step_time_s": 3,
             "val_loss_delta": 4, "time_vs_original": 2,
             "epoch_time_s": 2, "forward": 3, "backward": 3, "step": 3,
             "memory_pct": 3, "score": 3}  # MB: 2 decimals


def as_cells(table: str, rows: Rows, raw: bool = False) -> tuple[list[str], list[list[Any]]]:
    """Headers and cells of a table; floats rounded for reading unless `raw` (CSV).

    Seed spread: where a row holds `<key>_std` (several seeds), the cell reads "mean ± std";
    raw tables give the std its own column instead, so a spreadsheet can compute with it."""
    cols = [(k, h) for k, h in COLUMNS[table] if k != "differs" or any(r.get(k) for r in rows)]
    spread = {k for k, _h in cols if any(row.get(f"{k}_std") is not None for row in rows)}
    headers, cells = [], [[] for _ in rows]
    for k, h in cols:
        digits = PRECISION.get(k, 2)
        headers.append(h)
        for row, out in zip(rows, cells):
            out.append(_fmt(row.get(k), digits, raw, None if raw else row.get(f"{k}_std")))
        if raw and k in spread:
            headers.append(f"{h} std")
            for row, out in zip(rows, cells):
                out.append(row.get(f"{k}_std"))
    return headers, cells


def _fmt(value: Any, digits: int, raw: bool, std: float | None = None) -> Any:
    if not isinstance(value, float) or raw:
        return value
    return f"{value:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def loss_curves(db: DB, image_size: int | None = None) -> Rows:
    """Per-step training loss of every finished run (maxres probes left out); a run that did
    not train keeps its flat line, named as such."""
    db_ = db if isinstance(db, ResultsDB) else ResultsDB(db)
    keep = {r["id"]: r for r in load_runs(db) if r["status"] == "ok"
            and (image_size is None or r["image_size"] == image_size)}
    rows = db_.query("SELECT run_id, step, value FROM series WHERE name = 'loss' AND rank = 0 "
                     "ORDER BY run_id, step")
    return [{"run_id": s["run_id"], "name": keep[s["run_id"]]["name"] + (
                 f" ({NOT_TRAINED})" if did_not_train(keep[s["run_id"]]) else ""),
             "image_size": keep[s["run_id"]]["image_size"], "step": s["step"], "loss": s["value"]}
            for s in rows if s["run_id"] in keep]
