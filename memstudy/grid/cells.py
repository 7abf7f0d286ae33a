"""One run in its own process: `python -m memstudy run --config <db>.cells/<hash>.toml`.

The child gets its own process group (a timeout kills it and anything it started) and dies
with its parent (PR_SET_PDEATHSIG), so killing the runner leaves no orphan that could record
a run behind a rerun's back. A killed child leaves nothing: the store writes a run in one
transaction. The cell's log is appended to, each attempt under a header naming its runner, so
a retry or another runner never overwrites an earlier attempt's log.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from memstudy.config import CELL_THREADS_ENV, RunConfig, load_toml
from memstudy.errors import ConfigError
import memstudy.grid.forkserver as forkserver
from memstudy.grid.forkserver import die_with_parent
from memstudy.grid.spec import config_hash
from memstudy.runner import resolved, run_name
from memstudy.store import ResultsDB, RunRecord, describe_outcome

KILLED = "killed"  # outcomes that leave no record: a rerun runs the cell again
CRASHED = "crashed"


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """A RunConfig dict as TOML (None values are left out: they are the defaults)."""
    scalars = [f"{k} = {_toml_value(v)}" for k, v in data.items()
               if v is not None and not isinstance(v, dict)]
    tables = [f"\n[{prefix}{k}]\n" + to_toml(v, f"{prefix}{k}.") for k, v in data.items()
              if isinstance(v, dict)]
    return "\n".join(scalars) + "\n" + "".join(tables)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {v!r} to a cell config")


def write_cell_config(config: RunConfig, folder: Path) -> Path:
    """<folder>/<hash>.toml, checked to load back to the same config hash."""
    folder.mkdir(parents=True, exist_ok=True)
    key = config_hash(config)
    path = folder / f"{key}.toml"
    path.write_text(to_toml(config.to_dict()))
    if config_hash(load_toml(path)) != key:
        raise RuntimeError(f"{path} does not load back to the same configuration")
    return path


def cells_folder(db_path: str | Path) -> Path:
    db_path = Path(db_path)
    return db_path.parent / f"{db_path.stem}.cells"


@dataclass
class CellTimes:
    """Where a recorded cell's wall time went, from the runner's clock and the run's record
    (one host, so the clocks agree): `start` from the runner starting the cell to the run's
    start (process or fork, imports, data, the CUDA context and the budget's measurement),
    `steps` the training steps (the epochs' time, the first step's cuDNN set-up and lazy
    kernel loading included; None when no epoch ended, e.g. out of memory), `within` the rest
    of the run (model build, validation, failure handling, the record's figures) and `end`
    from the run's end to the runner seeing the cell exit (writing the record, the process's
    exit, the runner's polling)."""
    wall: float
    start: float
    within: float
    end: float
    steps: float | None = None
    first_step: float | None = None

    @classmethod
    def of_run(cls, db: ResultsDB, run, started: float, ended: float) -> "CellTimes":
        loop = db.query("SELECT SUM(time_s) AS s FROM epochs WHERE run_id = ? AND rank = 0",
                        (run["id"],))[0]["s"]
        first = db.query("SELECT value FROM metrics WHERE run_id = ? AND rank = 0 AND "
                         "phase = 'run' AND name = 'first_step_time_s'", (run["id"],))
        in_run = run["finished_at"] - run["started_at"]
        return cls(wall=ended - started, start=run["started_at"] - started,
                   within=in_run - (loop or 0.0), end=ended - run["finished_at"], steps=loop,
                   first_step=first[0]["value"] if first else None)

    def describe(self) -> str:
        steps = ("" if self.steps is None else f", steps {self.steps:.1f} s"
                 + (f" (first {self.first_step:.1f} s)" if self.first_step is not None else ""))
        rest = "build and validation" if self.steps is not None else "run"
        return (f"{self.wall:.1f} s: start {self.start:.1f} s{steps}, {rest} {self.within:.1f} s,"
                f" end {self.end:.1f} s")


class CellProcess:
    """A running `memstudy run` child in its own process group, with its log file."""

    times: CellTimes | None = None  # set by finish() once the cell's run is recorded

    def __init__(self, config: RunConfig, db_path: str | Path, gpu: str | None = None,
                 threads: int | None = None):
        """`threads`: the cell's CPU threads (CELL_THREADS_ENV), None: torch's default."""
        self.config, self.db_path, self.gpu = config, str(db_path), gpu
        folder = cells_folder(db_path)
        toml = write_cell_config(config, folder)
        self.hash = config_hash(config)
        self.log_path = folder / f"{self.hash}.log"
        self.before = _last_run_id(ResultsDB(db_path), self.hash)  # earlier attempts' runs
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        if threads is not None:
            env[CELL_THREADS_ENV] = str(threads)
        # progress lines go to the cell's log: `tail -f` it to follow a long cell
        cmd = [sys.executable, "-m", "memstudy", "--db", self.db_path, "run", "--config", str(toml)]
        parent = os.getpid()
        with open(self.log_path, "a") as log:  # one header per attempt: logs are never overwritten
            log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} attempt by the runner "
                      f"{socket.gethostname()} pid {parent}: {' '.join(cmd)}\n")
        if (server := forkserver.server()) is not None:  # imports paid once (grid/forkserver.py)
            cells = {"MEMSTUDY_CACHE": image_cache(db_path)}  # images made once per grid
            self.proc = server.popen(cmd[1:], {**cells, **env}, self.log_path)
            self.started = time.time()
            return
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True,
                                         preexec_fn=lambda: die_with_parent(parent))
        self.started = time.time()

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        """SIGKILL the whole process group (the cell and anything it started)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def finish(self, timed_out: bool = False, again: str | None = None) -> str:
        """The cell's outcome: its recorded status (', did not train' added for a run whose loss
        never moved: memstudy.did_train), 'timeout' (recorded here), or killed/crashed.
        A recorded run also leaves where the cell's time went in `self.times`."""
        ended = time.time()
        db = ResultsDB(self.db_path)
        rows = db.query("SELECT id, status, failed_phase, trained, started_at, finished_at FROM runs "
                        "WHERE config_hash = ? AND id > ? ORDER BY id DESC LIMIT 1",
                        (self.hash, self.before))
        if rows:
            r = rows[0]
            self.times = CellTimes.of_run(db, r, self.started, ended)
            return describe_outcome(r["status"], r["failed_phase"], r["trained"])
        if timed_out:
            record_timeout(db, self.config, self.hash, self.started, self.gpu,
                           *([again] if again else []))
            return "error in timeout"
        rc = self.proc.returncode
        return f"{KILLED} by signal {-rc}" if rc < 0 else f"{CRASHED} (exit {rc}, see {self.log_path})"


def image_cache(db_path: str | Path) -> str:
    """The on-disk image cache of a grid's cells: $MEMSTUDY_CACHE, else beside the cells, so
    each image is made once per grid, not once per cell."""
    return os.environ.get("MEMSTUDY_CACHE") or str(cells_folder(db_path) / "phantoms")


def cache_images(configs: list[RunConfig], db_path: str | Path) -> str | None:
    """Before the cells start, the fork server's workers fill the image cache of each (data,
    size) over the CPU's cores (grid/forkserver.py). Says what was done and how long the
    server's start and this took (once per grid); None without a fork server."""
    started = time.time()
    server = forkserver.server() if configs else None
    if server is None:
        return None
    data = {}  # one entry per (data settings, size): the cells' datasets differ in nothing else
    for c in configs:
        d = c.to_dict()
        key = json.dumps([d["data"], d["train"]["image_size"]], sort_keys=True, default=str)
        data.setdefault(key, {"config": d, "cache": image_cache(db_path)})
    server.fill_caches(list(data.values()))
    return (f"fork server ready and the images of {len(data)} (data, size) cached in "
            f"{time.time() - started:.1f} s")


def record_timeout(db: ResultsDB, config: RunConfig, key: str, started: float,
                   gpu: str | None, again: str = "memstudy grid SPEC --retry timeout --timeout "
                   "SECONDS") -> None:
    record_stopped(db, config, key, started, gpu, "timeout",
                   f"cell exceeded its timeout of {time.time() - started:.0f} s and was killed; "
                   f"run it again with a longer timeout: {again}")


def record_stopped(db: ResultsDB, config: RunConfig, key: str, started: float,
                   gpu: str | None, phase: str, why: str) -> None:
    """Record a run stopped from outside (`phase` 'timeout' or 'interrupted') as status error:
    nothing was measured, but the attempt and its cause are on record."""
    info = {"host": os.uname().nodename, "device": config.train.device, "gpu_slot": gpu}
    name = run_name(config)
    config = resolved(copy.deepcopy(config))  # stored like every run: canonical techniques
    db.record(RunRecord(config=config.to_dict(), config_hash=key, name=name,
                        status="error", env=info, started_at=started, label=config.label,
                        failed_phase=phase, error=why))


def _last_run_id(db: ResultsDB, key: str) -> int:
    rows = db.query("SELECT MAX(id) AS id FROM runs WHERE config_hash = ?", (key,))
    return rows[0]["id"] or 0


def run_isolated(config: RunConfig, db_path: str | Path, timeout_s: float | None = None,
                 gpu: str | None = None, poll_s: float = 0.1, watch: "Watch | None" = None
                 ) -> str:
    """Run one configuration in its own process and wait; returns its outcome. `watch`: a
    caller's progress lines and how a timeout or an interrupt is recorded (advise --confirm);
    without it, a timeout names the grid's retry and an interrupted run is not recorded (a
    grid reruns it)."""
    child, started = None, time.time()
    try:  # an interrupt while the child starts (the fork server's imports) is recorded too
        child = CellProcess(config, db_path, gpu)
        shown = child.started
        while child.poll() is None:
            if timeout_s is not None and time.time() - child.started > timeout_s:
                child.kill()
                return child.finish(timed_out=True, again=watch.again if watch else None)
            if watch and time.time() - shown >= watch.every_s:
                shown = time.time()
                watch.progress(f"  {shown - child.started:.0f} s: {last_line(child.log_path)}")
            time.sleep(poll_s)
    except BaseException as exc:
        if child is not None:
            child.kill()
        if watch and isinstance(exc, KeyboardInterrupt):
            record_stopped(ResultsDB(db_path), config, config_hash(config), started, gpu,
                           "interrupted", watch.interrupted)
        raise
    return child.finish()


@dataclass
class Watch:
    """What run_isolated tells and records for a caller that waits on one run."""
    progress: Callable[[str], None]
    every_s: float  # between progress lines
    again: str  # the command that runs it with a longer time limit
    interrupted: str  # the error recorded for a run stopped by Ctrl-C or SIGTERM


def last_line(log: Path) -> str:
    """The last line a cell logged (its progress), or that it has logged nothing yet."""
    try:
        with open(log, "rb") as fh:
            fh.seek(max(fh.seek(0, os.SEEK_END) - 4096, 0))
            lines = [ln for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return lines[-1].strip() if lines and not lines[-1].startswith("===") else "starting"
