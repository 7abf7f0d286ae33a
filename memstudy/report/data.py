"""Reading a results database for reports: runs with their per-phase figures and losses.

Torch-free on purpose (sqlite3 and json only), so notebooks and `memstudy report` start fast.
"""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from memstudy.errors import ConfigError
from memstudy.phases import TRAIN_PHASES  # noqa: F401 (reports import it from here)
from memstudy.store import PROBE_LABEL, RANK_MAX, RANK_MEAN, ResultsDB  # noqa: F401
from memstudy.did_train import judge


def open_db(db: str | Path | ResultsDB) -> ResultsDB:
    if isinstance(db, ResultsDB):
        return db
    if not Path(db).is_file():
        raise ConfigError(f"results database {str(db)!r} not found; run a grid first "
                          "(memstudy grid examples/quick.toml) or pass --db / set MEMSTUDY_DB")
    return ResultsDB(db, create=False)  # a report reads: it adds nothing to the file


def gpu_shared(run: dict[str, Any]) -> bool:
    """Another process held a CUDA context on the run's GPU while it ran (metric
    `gpu_other_processes`, memstudy.meters.nvml.GpuNeighbours): its times are not its own."""
    return bool(run["metrics"].get("run", {}).get("gpu_other_processes"))


def step_time(run: dict[str, Any]) -> float | None:
    """The run's step time in seconds; None where its GPU was shared (`gpu_shared`): the
    reports compare only times of runs that had their GPU to themselves (their memory figures,
    from the run's own allocator, stay)."""
    return None if gpu_shared(run) else run["metrics"].get("run", {}).get("step_time_s")


def epoch_time(run: dict[str, Any]) -> float | None:
    """The time of the run's last epoch (rank 0) in seconds; None where its GPU was shared."""
    return None if gpu_shared(run) else (run["last_epoch"] or {}).get("time_s")


def device_of(run: dict[str, Any]) -> str:
    """The device a run is reported under: its GPU's name, else 'cpu' (or the device string)."""
    return run["gpu_name"] or ("cpu" if run["device"].startswith("cpu") else run["device"])


def phase_peak(m: dict[str, float]) -> float | None:
    """A phase's peak memory above its start: allocator on CUDA, tensor meter on the CPU."""
    for key in ("alloc_peak_bytes", "tensor_peak_bytes"):
        if key in m:
            return m[key]
    return None


def absolute_phase_peaks(metrics: dict[str, dict[str, float]], env: dict) -> dict[str, float]:
    """Per training phase, the absolute peak of what a budget caps: allocator bytes plus the
    CUDA context on CUDA (context measured when a budget was applied, else 0), live tensor
    bytes (tensor meter, parameters and optimizer state included) on the CPU."""
    context = env.get("cuda_context_bytes", 0)
    peaks = {}
    for phase in TRAIN_PHASES:
        m = metrics.get(phase, {})
        if "alloc_peak_bytes" in m:
            peaks[phase] = m["alloc_start_bytes"] + m["alloc_peak_bytes"] + context
        elif "tensor_peak_bytes" in m:
            peaks[phase] = m["tensor_start_bytes"] + m["tensor_peak_bytes"]
    return peaks


def load_runs(db: str | Path | ResultsDB, probes: bool = False) -> list[dict[str, Any]]:
    """Every run as a dict: the runs row, `metrics` {phase: {name: value}} (a distributed run:
    the mean over ranks), `env`, `config`, `last_epoch` (losses of the final epoch, rank 0),
    `peaks` (absolute phase peaks; a distributed run: the maximum over ranks) and `trained`
    (False: the run did not train, memstudy.did_train; None: not judged).
    maxres probes are left out unless `probes`."""
    db = open_db(db)
    runs = db.runs()
    metrics: dict[tuple[int, int], dict[str, dict[str, float]]] = {}
    for row in db.query("SELECT run_id, rank, phase, name, value FROM metrics WHERE rank <= 0"):
        by_phase = metrics.setdefault((row["run_id"], row["rank"]), {})
        by_phase.setdefault(row["phase"], {})[row["name"]] = row["value"]
    last: dict[int, dict[str, Any]] = {}
    for row in db.query("SELECT * FROM epochs WHERE rank = 0 ORDER BY run_id, epoch"):
        last[row["run_id"]] = row
    out = []
    for run in runs:
        if run["label"] == PROBE_LABEL and not probes:
            continue
        own = metrics.get((run["id"], 0), {})
        run["metrics"] = metrics.get((run["id"], RANK_MEAN), own)
        run["env"] = json.loads(run.pop("env_json"))
        run["config"] = json.loads(run.pop("config_json"))
        run["last_epoch"] = last.get(run["id"])
        run["peaks"] = absolute_phase_peaks(metrics.get((run["id"], RANK_MAX), own), run["env"])
        out.append(run)
    _fill_trained(db, out)
    return out


def _fill_trained(db: ResultsDB, runs: list[dict[str, Any]]) -> None:
    """`trained` of every run as a bool or None: the recorded flag, else (a run recorded before
    the flag, or a database opened read-only) judged by the same rule from its loss series."""
    ranges: dict[int, list] = {}
    if any(r.get("trained") is None for r in runs):  # per rank: (steps, min, max) of its loss
        for row in db.query("SELECT run_id, COUNT(*) AS n, MIN(value) AS lo, MAX(value) AS hi "
                            "FROM series WHERE name = 'loss' GROUP BY run_id, rank"):
            ranges.setdefault(row["run_id"], []).append((row["n"], row["lo"], row["hi"]))
    for run in runs:
        flag = run.get("trained")
        run["trained"] = judge(ranges.get(run["id"], [])) if flag is None else bool(flag)


def did_not_train(run: dict[str, Any]) -> bool:
    """A finished run whose training loss never moved (memstudy.did_train): its memory and time
    are measured, its losses say nothing about the technique set."""
    return run["status"] == "ok" and run["trained"] is False


def load_maxres(db: str | Path | ResultsDB) -> list[dict[str, Any]]:
    """Rows of the maxres table (memstudy.maxres), newest last; [] if none was recorded."""
    db = open_db(db)
    try:
        return db.query("SELECT * FROM maxres ORDER BY id")
    except sqlite3.OperationalError:  # no maxres table: no search was run on this database
        return []
