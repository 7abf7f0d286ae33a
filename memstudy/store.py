"""Results database: one SQLite file, one transaction per run. The one module that knows the
schema and opens SQLite connections (runs, their metrics / epochs / series, maxres results).

A run is written whole or not at all (`record` is a single transaction), so a crash or a
kill never leaves a half-written run, and runs written by earlier processes are never
touched. WAL mode and a busy timeout let grid cells in separate processes write at once.
Default path: ./results/memstudy.sqlite, or $MEMSTUDY_DB. Torch-free.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

DEFAULT_DB = "results/memstudy.sqlite"
STATUSES = ("ok", "oom", "error", "diverged")
# metrics.rank of a distributed run's merged rows (memstudy.distributed.records): the mean over
# ranks, as the study reports per GPU, and the maximum, which decides whether a run fits a budget
RANK_MEAN, RANK_MAX = -1, -2
PROBE_LABEL = "maxres probe"  # runs.label of memstudy maxres probes (reports leave them out)

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    config_hash TEXT NOT NULL,
    name TEXT NOT NULL,           -- technique set as given, e.g. 'amp:bf16+checkpoint', or 'original'
    label TEXT,
    status TEXT NOT NULL CHECK (status IN ('ok', 'oom', 'error', 'diverged')),
    failed_phase TEXT,            -- phase of an oom / error / divergence
    error TEXT,
    image_size INTEGER NOT NULL,  -- a square's side; 'HxW' and 'native' (memstudy.sizes) stay TEXT
    batch_size INTEGER NOT NULL,
    world_size INTEGER NOT NULL,
    device TEXT NOT NULL,
    gpu_name TEXT,
    started_at REAL NOT NULL,
    finished_at REAL NOT NULL,
    config_json TEXT NOT NULL,
    env_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_hash ON runs (config_hash);
CREATE TABLE IF NOT EXISTS metrics (
    run_id INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    phase TEXT NOT NULL,          -- forward / backward / step / validation / run
    name TEXT NOT NULL,           -- e.g. alloc_peak_bytes, time_s (docs/metrics.md)
    value REAL,
    PRIMARY KEY (run_id, rank, phase, name)
);
CREATE TABLE IF NOT EXISTS epochs (
    run_id INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    steps INTEGER NOT NULL,
    train_loss REAL,
    val_loss REAL,
    val_ssim REAL,
    val_psnr REAL,
    time_s REAL NOT NULL,
    PRIMARY KEY (run_id, rank, epoch)
);
CREATE TABLE IF NOT EXISTS series (
    run_id INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    step INTEGER NOT NULL,
    name TEXT NOT NULL,           -- per-step values: loss, batch_size, lr, precision/<layer>, ...
    value REAL,
    PRIMARY KEY (run_id, rank, step, name)
);
CREATE TABLE IF NOT EXISTS maxres (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    config_key TEXT NOT NULL,     -- hash of the probe config without its image size
    name TEXT NOT NULL,           -- technique set, as runs.name
    techniques_json TEXT NOT NULL,
    budget TEXT NOT NULL,
    budget_bytes INTEGER NOT NULL,
    device TEXT,
    gpu_name TEXT,
    batch_size INTEGER NOT NULL,
    fit_sizes_json TEXT NOT NULL,
    fit_phase TEXT,               -- the phase whose fitted peak reaches the budget first
    fit_a REAL,                   -- that phase's peak bytes = fit_a + fit_b * pixels
    fit_b REAL,
    predicted_px INTEGER,         -- prediction floored to the search grid
    found_px INTEGER,             -- largest probed size that trained; NULL: not even the smallest
    step_time_s REAL,             -- time per step at found_px
    peak_bytes REAL,              -- peak memory at found_px
    probes_json TEXT NOT NULL,    -- [[px, status, peak_bytes], ...] in probing order
    error TEXT,
    created_at REAL NOT NULL
);
"""
# Created by the first `memstudy advise`, not on open: reading a database (a report of a
# committed benchmark file) must not change it.
PREDICTIONS_SCHEMA = """
CREATE TABLE IF NOT EXISTS predictions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at REAL NOT NULL,     -- runs finished after it check the prediction (advise --check)
    gpu_name TEXT NOT NULL,       -- the device the fit's runs were on (report device name)
    name TEXT NOT NULL,           -- technique set, as runs.name
    image_size TEXT NOT NULL,     -- canonical size (memstudy.sizes), as text
    batch_size INTEGER NOT NULL,
    budget TEXT NOT NULL,
    budget_bytes INTEGER NOT NULL,
    fits INTEGER NOT NULL,        -- 1: predicted to train under the budget
    peak_bytes REAL,              -- predicted absolute peak (CUDA context included)
    step_time_s REAL,             -- predicted time per step
    confidence TEXT NOT NULL      -- measured / interpolated / extrapolated ... (docs/advise.md)
);
"""
PREDICTION_COLUMNS = ("created_at", "gpu_name", "name", "image_size", "batch_size", "budget",
                      "budget_bytes", "fits", "peak_bytes", "step_time_s", "confidence")
MAXRES_COLUMNS = ("config_key", "name", "techniques_json", "budget", "budget_bytes", "device",
                  "gpu_name", "batch_size", "fit_sizes_json", "fit_phase", "fit_a", "fit_b",
                  "predicted_px", "found_px", "step_time_s", "peak_bytes", "probes_json", "error",
                  "created_at")


@dataclass
class RunRecord:
    config: dict[str, Any]
    config_hash: str
    name: str
    status: str
    env: dict[str, Any]
    started_at: float
    finished_at: float = field(default_factory=time.time)
    label: str | None = None
    failed_phase: str | None = None
    error: str | None = None
    metrics: list[tuple[int, str, str, float]] = field(default_factory=list)  # rank, phase, name, value
    epochs: list[dict[str, Any]] = field(default_factory=list)  # rank, epoch, steps, losses, time_s
    series: list[tuple[int, int, str, float]] = field(default_factory=list)  # rank, step, name, value


def default_db_path() -> str:
    return os.environ.get("MEMSTUDY_DB", DEFAULT_DB)


class ResultsDB:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path or default_db_path())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as con:
            con.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        con = sqlite3.connect(self.path, timeout=60)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA foreign_keys=ON")
        con.row_factory = sqlite3.Row
        return con

    def record(self, rec: RunRecord) -> int:
        if rec.status not in STATUSES:
            raise ValueError(f"status {rec.status!r} is not one of {STATUSES}")
        train = rec.config["train"]
        con = self._connect()
        try:
            with con:  # one transaction: the whole run or nothing
                cur = con.execute(
                    "INSERT INTO runs (config_hash, name, label, status, failed_phase, error, "
                    "image_size, batch_size, world_size, device, gpu_name, started_at, finished_at, "
                    "config_json, env_json) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (rec.config_hash, rec.name, rec.label, rec.status, rec.failed_phase, rec.error,
                     train["image_size"], train["batch_size"], rec.config.get("world_size", 1),
                     str(rec.env.get("device")), rec.env.get("gpu_name"), rec.started_at,
                     rec.finished_at, json.dumps(rec.config, sort_keys=True),
                     json.dumps(rec.env, sort_keys=True, default=str)))
                run_id = int(cur.lastrowid)
                con.executemany("INSERT INTO metrics VALUES (?,?,?,?,?)",
                                [(run_id, r, p, n, _num(v)) for r, p, n, v in rec.metrics])
                con.executemany(
                    "INSERT INTO epochs VALUES (?,?,?,?,?,?,?,?,?)",
                    [(run_id, e.get("rank", 0), e["epoch"], e["steps"], e.get("train_loss"),
                      e.get("val_loss"), e.get("val_ssim"), e.get("val_psnr"), e["time_s"])
                     for e in rec.epochs])
                con.executemany("INSERT INTO series VALUES (?,?,?,?,?)",
                                [(run_id, r, s, n, _num(v)) for r, s, n, v in rec.series])
            return run_id
        finally:
            con.close()

    def replace_maxres(self, row: dict[str, Any]) -> None:
        """Store one maxres result (MAXRES_COLUMNS), replacing the earlier one of the same
        config_key, in one transaction."""
        missing = set(MAXRES_COLUMNS) - set(row)
        if missing:
            raise ValueError(f"maxres row lacks {sorted(missing)}")
        con = self._connect()
        try:
            with con:
                con.execute("DELETE FROM maxres WHERE config_key = ?", (row["config_key"],))
                con.execute(f"INSERT INTO maxres ({', '.join(MAXRES_COLUMNS)}) VALUES "
                            f"({', '.join('?' * len(MAXRES_COLUMNS))})",
                            [row[c] for c in MAXRES_COLUMNS])
        finally:
            con.close()

    def add_predictions(self, rows: list[dict[str, Any]]) -> None:
        """Store `memstudy advise` predictions (PREDICTION_COLUMNS each), in one transaction."""
        con = self._connect()
        try:
            with con:
                con.executescript(PREDICTIONS_SCHEMA)
                con.executemany(f"INSERT INTO predictions ({', '.join(PREDICTION_COLUMNS)}) "
                                f"VALUES ({', '.join('?' * len(PREDICTION_COLUMNS))})",
                                [[row[c] for c in PREDICTION_COLUMNS] for row in rows])
        finally:
            con.close()

    def query(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        con = self._connect()
        try:
            return [dict(row) for row in con.execute(sql, params)]
        finally:
            con.close()

    def runs(self, status: str | None = None) -> list[dict[str, Any]]:
        where, params = ("WHERE status = ?", (status,)) if status else ("", ())
        return self.query(f"SELECT * FROM runs {where} ORDER BY id", params)

    def recorded_hashes(self) -> set[str]:
        return {r["config_hash"] for r in self.query("SELECT DISTINCT config_hash FROM runs")}

    def metrics(self, run_id: int) -> dict[tuple[int, str], dict[str, float]]:
        out: dict[tuple[int, str], dict[str, float]] = {}
        for row in self.query("SELECT * FROM metrics WHERE run_id = ?", (run_id,)):
            out.setdefault((row["rank"], row["phase"]), {})[row["name"]] = row["value"]
        return out

    def epochs(self, run_id: int) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM epochs WHERE run_id = ? ORDER BY rank, epoch", (run_id,))

    def series(self, run_id: int, name_like: str = "%") -> Iterator[dict[str, Any]]:
        yield from self.query("SELECT * FROM series WHERE run_id = ? AND name LIKE ? "
                              "ORDER BY rank, step", (run_id, name_like))


def merge_databases(target: str | Path, sources: list[str | Path]) -> int:
    """Copy every run (with its metrics, epochs, series) of `sources` into `target`, renumbered,
    in one transaction per source; other tables (e.g. maxres) are copied row by row. Returns
    the number of runs copied. Used to gather benchmark databases into one for the notebooks."""
    db = ResultsDB(target)
    copied = 0
    for src in sources:
        con = db._connect()
        try:
            con.execute("ATTACH DATABASE ? AS src", (str(src),))
            with con:
                copied += _merge_attached(con)
        finally:
            con.close()
    return copied


def _merge_attached(con: sqlite3.Connection) -> int:
    cols = [r[1] for r in con.execute("PRAGMA src.table_info(runs)") if r[1] != "id"]
    ids = [r[0] for r in con.execute("SELECT id FROM src.runs ORDER BY id")]
    for old in ids:
        new = con.execute(f"INSERT INTO runs ({', '.join(cols)}) SELECT {', '.join(cols)} "
                          "FROM src.runs WHERE id = ?", (old,)).lastrowid
        for table in ("metrics", "epochs", "series"):
            rest = [r[1] for r in con.execute(f"PRAGMA src.table_info({table})") if r[1] != "run_id"]
            con.execute(f"INSERT INTO {table} (run_id, {', '.join(rest)}) SELECT ?, "
                        f"{', '.join(rest)} FROM src.{table} WHERE run_id = ?", (new, old))
    known = {"runs", "metrics", "epochs", "series", "sqlite_sequence"}
    for (table, sql) in con.execute("SELECT name, sql FROM src.sqlite_master WHERE type = 'table'"):
        if table in known:
            continue
        con.execute(sql.replace("CREATE TABLE", "CREATE TABLE IF NOT EXISTS", 1))
        rest = [r[1] for r in con.execute(f"PRAGMA src.table_info({table})") if r[1] != "id"]
        con.execute(f"INSERT INTO {table} ({', '.join(rest)}) SELECT {', '.join(rest)} FROM src.{table}")
    return len(ids)


def _num(value: Any) -> float | None:
    return None if value is None else float(value)
