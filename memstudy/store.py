"""Results database: one SQLite file, one transaction per run. The one module that knows the
schema and opens SQLite connections (runs, their metrics / epochs / series, maxres results).

A run is written whole or not at all (`record` is a single transaction), so a crash or a
kill never leaves a half-written run, and runs written by earlier processes are never
touched. WAL mode and a busy timeout let grid cells in separate processes write at once.
Default path: ./results/memstudy.sqlite, or $MEMSTUDY_DB. Torch-free.

Only a missing path is created (in a scratch file linked into place, so a concurrent opener
never sees a half-made database); an existing file must already be a memstudy database: an
empty file, random bytes or another program's SQLite file is refused, never rewritten.
Every SQLite failure (not a database, locked, read-only) becomes one `DatabaseError` naming
the file and what to do. Commands that write call `check_writable` before they build anything;
a run whose store fails anyway is kept in a side database beside the file (`keep_aside`), and
the error names it and the `memstudy merge` that adds it. Each run carries a random
`run_uid`, so `merge_databases` copies a run once however often it is merged (older runs
without one: by config hash and start time).
"""
from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from memstudy.errors import MemstudyError

DEFAULT_DB = "results/memstudy.sqlite"
STATUSES = ("ok", "oom", "error", "diverged")
# metrics.rank of a distributed run's merged rows (memstudy.distributed.records): the mean over
# ranks, as the study reports per GPU, and the maximum, which decides whether a run fits a budget
RANK_MEAN, RANK_MAX = -1, -2
PROBE_LABEL = "maxres probe"  # runs.label of memstudy maxres probes (reports leave them out)
NOT_TRAINED = "did not train"  # how outcomes name a run whose runs.trained is 0

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    config_hash TEXT NOT NULL,
    name TEXT NOT NULL,           -- technique set as given, e.g. 'amp:bf16+checkpoint', or 'original'
    label TEXT,
    status TEXT NOT NULL CHECK (status IN ('ok', 'oom', 'error', 'diverged')),
    failed_phase TEXT,            -- phase of an oom / error / divergence
    error TEXT,
    image_size INTEGER NOT NULL,  -- a square's side; 'HxW' and 'native' (memstudy.image_sizes) stay TEXT
    batch_size INTEGER NOT NULL,
    world_size INTEGER NOT NULL,
    device TEXT NOT NULL,
    gpu_name TEXT,
    started_at REAL NOT NULL,
    finished_at REAL NOT NULL,
    config_json TEXT NOT NULL,
    env_json TEXT NOT NULL,
    trained INTEGER,              -- 0: did not train, 1: trained, NULL: not judged (memstudy.did_train)
    run_uid TEXT                  -- random id of the run, kept by merges (NULL: older runs)
);
CREATE INDEX IF NOT EXISTS runs_hash ON runs (config_hash);
CREATE TABLE IF NOT EXISTS claims (  -- grid cells being run now (memstudy.grid.claims)
    config_hash TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    claimed_at REAL NOT NULL,
    heartbeat REAL NOT NULL       -- refreshed by the runner while the cell runs
);
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
    val_dice REAL,                -- train.task = 'segment': Dice / IoU of the validation set
    val_iou REAL,                 -- (NULL for enhancement, and for runs recorded before them)
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
    image_size TEXT NOT NULL,     -- canonical size (memstudy.image_sizes), as text
    batch_size INTEGER NOT NULL,
    budget TEXT NOT NULL,
    budget_bytes INTEGER NOT NULL,
    fits INTEGER NOT NULL,        -- 1: predicted to train under the budget
    peak_bytes REAL,              -- predicted absolute peak (CUDA context included)
    step_time_s REAL,             -- predicted time per step
    confidence TEXT NOT NULL,     -- measured / interpolated / extrapolated ... (docs/advise.md)
    experiment TEXT               -- the fit's settings but size and budget, JSON (NULL: older)
);
"""
PREDICTION_COLUMNS = ("created_at", "gpu_name", "name", "image_size", "batch_size", "budget",
                      "budget_bytes", "fits", "peak_bytes", "step_time_s", "confidence",
                      "experiment")
# the epochs table's columns, in its order (SCHEMA; a migrated database adds the last two)
SEGMENT_EPOCH_COLUMNS = ("val_dice", "val_iou")
EPOCH_COLUMNS = ("run_id", "rank", "epoch", "steps", "train_loss", "val_loss", "val_ssim",
                 "val_psnr", "time_s", *SEGMENT_EPOCH_COLUMNS)
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
    run_uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    trained: bool | None = None  # memstudy.did_train.judge over the run's loss series
    metrics: list[tuple[int, str, str, float]] = field(default_factory=list)  # rank, phase, name, value
    epochs: list[dict[str, Any]] = field(default_factory=list)  # rank, epoch, steps, losses, time_s
    series: list[tuple[int, int, str, float]] = field(default_factory=list)  # rank, step, name, value


SQLITE_HEADER = b"SQLite format 3\x00"
BUSY_TIMEOUT_S = 60


class DatabaseError(MemstudyError):
    """A results database that cannot be used; the message names the file and what to do."""


def describe_outcome(status: str, failed_phase: str | None, trained: bool | int | None = None) -> str:
    """A recorded run's outcome in a few words, as `memstudy run`, grids and reports show it:
    'ok', 'ok, did not train' (runs.trained = 0), 'oom in forward'."""
    text = status + (f" in {failed_phase}" if failed_phase else "")
    return text + (f", {NOT_TRAINED}" if trained is not None and not trained else "")


def default_db_path() -> str:
    return os.environ.get("MEMSTUDY_DB", DEFAULT_DB)


def check_database_file(path: Path) -> None:
    """Refuse an existing file that is not a memstudy database, before SQLite touches it."""
    if not path.exists():
        return
    if not path.is_file():
        raise DatabaseError(f"{path} is not a file; pass a results database (--db) or a new path")
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(SQLITE_HEADER))
    except OSError as exc:
        raise DatabaseError(f"cannot read {path} ({exc.strerror}); check its permissions") from None
    if not head:
        raise DatabaseError(f"{path} is an empty file, not a memstudy results database; "
                            "remove it or pass another --db (a new path is created)")
    if head != SQLITE_HEADER:
        raise DatabaseError(f"{path} is not an SQLite database (it starts with {head[:8]!r}); "
                            "pass a memstudy results database or a new path (--db)")


def explain(path: Path, exc: sqlite3.Error) -> DatabaseError:
    """One line for an SQLite failure on `path`: what happened and what to do."""
    text = str(exc)
    if "locked" in text or "busy" in text:
        why = (f"is locked by another process (waited {BUSY_TIMEOUT_S} s); wait for it to "
               "finish or pass another --db")
    elif "readonly" in text or "read-only" in text:
        why = "is read-only; make it and its folder writable or pass another --db"
    elif "not a database" in text or "malformed" in text:
        why = "is not a memstudy results database (or is damaged); pass another --db"
    elif "unable to open" in text:
        why = "cannot be opened; check that its folder exists and is writable"
    else:
        why = f"failed: {text}"
    return DatabaseError(f"{path} {why} (SQLite: {text})")


class ResultsDB:
    """A results database. `create=False` opens an existing one to read it: nothing is added
    to it (not even the tables of a newer memstudy)."""

    def __init__(self, path: str | Path | None = None, create: bool = True):
        self.path = Path(path or default_db_path())
        check_database_file(self.path)
        if not self.path.exists():
            if not create:
                raise DatabaseError(f"results database {self.path} not found; run a grid first "
                                    "or pass --db / set MEMSTUDY_DB")
            self._create()
        self._check_memstudy()
        if create:
            with self.transaction() as con:
                _migrate(con)

    def _create(self) -> None:
        """Build the schema in a scratch file and link it into place: a runner starting at the
        same moment finds either no file or a whole database, never an empty one."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DatabaseError(f"cannot create the folder of {self.path} ({exc.strerror}); "
                                "pass a --db in a writable folder") from None
        scratch = self.path.with_name(f".{self.path.name}.{os.getpid()}.new")
        try:
            con = sqlite3.connect(scratch)
            try:
                con.executescript(SCHEMA)
                _add_run_uid(con)
                con.execute("PRAGMA journal_mode=WAL")
            finally:
                con.close()
            _place(scratch, self.path)
        except FileExistsError:
            pass  # another process created it first: use theirs
        except (OSError, sqlite3.Error) as exc:
            raise DatabaseError(f"cannot create {self.path} ({exc}); pass a --db in a writable "
                                "folder") from None
        finally:
            scratch.unlink(missing_ok=True)

    def _check_memstudy(self) -> None:
        """Refuse another program's SQLite file, looking only (read-only, before any pragma
        of ours could change its header)."""
        try:
            con = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True,
                                  timeout=BUSY_TIMEOUT_S)
            try:
                tables = {r[0] for r in con.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table'")}
            finally:
                con.close()
        except sqlite3.Error as exc:
            raise explain(self.path, exc) from None
        if "runs" not in tables:
            raise DatabaseError(f"{self.path} is an SQLite database of another program (tables: "
                                f"{', '.join(sorted(tables)) or 'none'}), not memstudy results; "
                                "pass another --db")

    def _connect(self) -> sqlite3.Connection:
        con = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S)
        try:
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA foreign_keys=ON")
        except sqlite3.Error:
            con.close()
            raise
        con.row_factory = sqlite3.Row
        return con

    @contextmanager
    def transaction(self, immediate: bool = False) -> Iterator[sqlite3.Connection]:
        """A connection in one transaction (committed on success, rolled back on an error);
        `immediate` takes the write lock at once, for read-then-write decisions such as a
        grid cell's claim. SQLite failures come out as one DatabaseError."""
        try:
            con = self._connect()
        except sqlite3.Error as exc:
            raise explain(self.path, exc) from None
        try:
            if immediate:
                con.execute("BEGIN IMMEDIATE")
            with con:
                yield con
        except sqlite3.IntegrityError:
            raise  # a broken record (memstudy's bug), not the file's fault
        except sqlite3.Error as exc:
            raise explain(self.path, exc) from None
        finally:
            con.close()

    def record(self, rec: RunRecord) -> int:
        """Store the run in one transaction; where that fails (disk full, the file made
        read-only mid-run), the record goes to a side database (keep_aside) and the error
        says how to merge it: a run is never trained to be lost."""
        if rec.status not in STATUSES:
            raise ValueError(f"status {rec.status!r} is not one of {STATUSES}")
        try:
            return self._insert(rec)
        except DatabaseError as exc:
            raise DatabaseError(f"{exc}; {keep_aside(rec, self.path)}") from None

    def _insert(self, rec: RunRecord) -> int:
        train = rec.config["train"]
        with self.transaction() as con:  # one transaction: the whole run or nothing
            cur = con.execute(
                "INSERT INTO runs (config_hash, name, label, status, failed_phase, error, "
                "image_size, batch_size, world_size, device, gpu_name, started_at, finished_at, "
                "config_json, env_json, run_uid, trained) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (rec.config_hash, rec.name, rec.label, rec.status, rec.failed_phase, rec.error,
                 train["image_size"], train["batch_size"], rec.config.get("world_size", 1),
                 str(rec.env.get("device")), rec.env.get("gpu_name"), rec.started_at,
                 rec.finished_at, json.dumps(rec.config, sort_keys=True),
                 json.dumps(rec.env, sort_keys=True, default=str), rec.run_uid,
                 None if rec.trained is None else int(rec.trained)))
            run_id = int(cur.lastrowid)
            con.executemany("INSERT INTO metrics VALUES (?,?,?,?,?)",
                            [(run_id, r, p, n, _num(v)) for r, p, n, v in rec.metrics])
            con.executemany(
                f"INSERT INTO epochs ({', '.join(EPOCH_COLUMNS)}) "
                f"VALUES ({', '.join('?' * len(EPOCH_COLUMNS))})",
                [(run_id, e.get("rank", 0), e["epoch"], e["steps"], e.get("train_loss"),
                  e.get("val_loss"), e.get("val_ssim"), e.get("val_psnr"), e["time_s"],
                  e.get("val_dice"), e.get("val_iou")) for e in rec.epochs])
            con.executemany("INSERT INTO series VALUES (?,?,?,?,?)",
                            [(run_id, r, s, n, _num(v)) for r, s, n, v in rec.series])
        return run_id

    def replace_maxres(self, row: dict[str, Any]) -> None:
        """Store one maxres result (MAXRES_COLUMNS), replacing the earlier one of the same
        config_key, in one transaction."""
        missing = set(MAXRES_COLUMNS) - set(row)
        if missing:
            raise ValueError(f"maxres row lacks {sorted(missing)}")
        with self.transaction() as con:
            con.execute("DELETE FROM maxres WHERE config_key = ?", (row["config_key"],))
            con.execute(f"INSERT INTO maxres ({', '.join(MAXRES_COLUMNS)}) VALUES "
                        f"({', '.join('?' * len(MAXRES_COLUMNS))})",
                        [row[c] for c in MAXRES_COLUMNS])

    def add_predictions(self, rows: list[dict[str, Any]]) -> None:
        """Store `memstudy advise` predictions (PREDICTION_COLUMNS each), in one transaction."""
        with self.transaction() as con:  # SQLite failures as one DatabaseError naming the file
            con.execute(PREDICTIONS_SCHEMA)
            if "experiment" not in _columns(con, "main", "predictions"):  # an older advise's
                con.execute("ALTER TABLE predictions ADD COLUMN experiment TEXT")
            con.executemany(f"INSERT INTO predictions ({', '.join(PREDICTION_COLUMNS)}) "
                            f"VALUES ({', '.join('?' * len(PREDICTION_COLUMNS))})",
                            [[row[c] for c in PREDICTION_COLUMNS] for row in rows])

    def query(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        with self.transaction() as con:
            return [dict(row) for row in con.execute(sql, params)]

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


def check_writable(path: str | Path) -> None:
    """Refuse, before anything is built or trained, a database a command could not write: an
    existing file that is not a memstudy database or is read-only, or a folder where SQLite
    cannot create it or its journal (the -wal file beside it). One DatabaseError naming the
    path; a failure after this check (a full disk) is caught by `record` instead."""
    path = Path(path)
    check_database_file(path)
    if path.exists():
        ResultsDB(path, create=False)  # another program's SQLite file: refused by name
        if not os.access(path, os.W_OK):
            raise DatabaseError(f"{path} is read-only, so no run could be stored in it; make "
                                f"it writable (chmod u+w {path}) or pass another --db")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:  # created on first use
        folder = folder.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DatabaseError(f"cannot write in {folder}, the folder of {path} (SQLite keeps its "
                            "journal beside the database); make it writable or pass another --db")


def keep_aside(rec: RunRecord, path: Path) -> str:
    """Write a run that `path` could not store to a database of its own beside it (else in
    the temporary folder); returns the sentence that says where and how to merge it."""
    name = f"{path.stem}.unstored-{rec.run_uid[:12]}.sqlite"
    for folder in (path.parent, Path(tempfile.gettempdir())):
        side = folder / name
        try:
            ResultsDB(side)._insert(rec)
        except (DatabaseError, OSError):
            continue
        return (f"the run's record is kept in {side}; once {path} can be written, add it with "
                f"`memstudy --db {path} merge {side}`")
    return f"the run's record could not be kept beside {path} either (nor in {folder})"


def merge_databases(target: str | Path, sources: list[str | Path]) -> list[tuple[Path, int, int]]:
    """Copy every run (with its metrics, epochs, series) of `sources` into `target`, renumbered,
    in one transaction per source; other tables (e.g. maxres) row by row. A run already in
    `target` (same run_uid, or same config hash and start time for runs recorded before run
    ids) is not copied again, so merging twice adds nothing. Returns (source, copied, already
    there) per source. Used to gather benchmark databases into one for the notebooks."""
    db = ResultsDB(target)
    counts = []
    for src in map(Path, sources):
        ResultsDB(src, create=False)  # refuses anything but a memstudy database, by name
        if src.resolve() == db.path.resolve() or (db.path.exists() and src.samefile(db.path)):
            raise DatabaseError(f"{src} is the target database itself; nothing to merge "
                                "(pass another database to copy from)")
        with db.transaction() as con:
            con.execute("ATTACH DATABASE ? AS src", (str(src),))
            counts.append((src, *_merge_attached(con)))
    return counts


def _place(scratch: Path, path: Path) -> None:
    """Put the finished scratch database at `path` unless a file is there already (a hard
    link fails if it is; where the file system has no hard links, a rename after a check)."""
    try:
        os.link(scratch, path)
    except FileExistsError:
        raise
    except OSError:
        if path.exists():
            raise FileExistsError(path) from None
        os.replace(scratch, path)


def _columns(con: sqlite3.Connection, schema: str, table: str) -> list[str]:
    return [r[1] for r in con.execute(f"PRAGMA {schema}.table_info({table})")]


def _migrate(con: sqlite3.Connection) -> None:
    """Add what this memstudy records to a database of an older one (nothing if present)."""
    if {"run_uid", "trained"} <= set(_columns(con, "main", "runs")) and con.execute(
            "SELECT 1 FROM sqlite_master WHERE name = 'claims'").fetchone() \
            and set(SEGMENT_EPOCH_COLUMNS) <= set(_columns(con, "main", "epochs")):
        return
    try:
        con.executescript(SCHEMA)
        _add_run_uid(con)
        if "trained" not in _columns(con, "main", "runs"):  # older runs stay NULL: not judged
            con.execute("ALTER TABLE runs ADD COLUMN trained INTEGER")
        for column in SEGMENT_EPOCH_COLUMNS:  # older runs are enhancement: NULL
            if column not in _columns(con, "main", "epochs"):
                con.execute(f"ALTER TABLE epochs ADD COLUMN {column} REAL")
    except sqlite3.OperationalError as exc:
        if "readonly" not in str(exc):
            raise
        # a read-only older database still reads; writing to it names the problem then


def _add_run_uid(con: sqlite3.Connection) -> None:
    if "run_uid" not in _columns(con, "main", "runs"):
        con.execute("ALTER TABLE runs ADD COLUMN run_uid TEXT")
    con.execute("CREATE UNIQUE INDEX IF NOT EXISTS runs_uid ON runs (run_uid)")


def _merge_attached(con: sqlite3.Connection) -> tuple[int, int]:
    """Copy the attached `src` database's runs that `main` lacks; returns (copied, skipped)."""
    main_cols = set(_columns(con, "main", "runs"))
    cols = [c for c in _columns(con, "src", "runs") if c != "id" and c in main_cols]
    uid = "run_uid" if "run_uid" in cols else "NULL"
    copied = skipped = 0
    for old, run_uid, key, started in con.execute(
            f"SELECT id, {uid}, config_hash, started_at FROM src.runs ORDER BY id").fetchall():
        if con.execute("SELECT 1 FROM main.runs WHERE run_uid = ? OR (config_hash = ? AND "
                       "started_at = ?)", (run_uid, key, started)).fetchone():
            skipped += 1
            continue
        new = con.execute(f"INSERT INTO runs ({', '.join(cols)}) SELECT {', '.join(cols)} "
                          "FROM src.runs WHERE id = ?", (old,)).lastrowid
        for table in ("metrics", "epochs", "series"):
            rest = [c for c in _columns(con, "src", table) if c != "run_id"]
            con.execute(f"INSERT INTO {table} (run_id, {', '.join(rest)}) SELECT ?, "
                        f"{', '.join(rest)} FROM src.{table} WHERE run_id = ?", (new, old))
        copied += 1
    known = {"runs", "metrics", "epochs", "series", "claims", "sqlite_sequence"}
    for (table, sql) in con.execute("SELECT name, sql FROM src.sqlite_master WHERE type = 'table'"
                                    ).fetchall():
        if table in known:
            continue
        con.execute(sql.replace("CREATE TABLE", "CREATE TABLE IF NOT EXISTS", 1))
        rest = [c for c in _columns(con, "src", table) if c != "id"]
        for column in [c for c in rest if c not in _columns(con, "main", table)]:  # a newer's
            con.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
        listed = ", ".join(rest)  # rows the target holds already are not copied twice
        con.execute(f"INSERT INTO {table} ({listed}) SELECT {listed} FROM src.{table} "
                    f"EXCEPT SELECT {listed} FROM main.{table}")
    return copied, skipped


def _num(value: Any) -> float | None:
    return None if value is None else float(value)
