"""One run in its own process: `python -m memstudy run --config <db>.cells/<hash>.toml`.

The child gets its own process group (a timeout kills it and anything it started) and dies
with its parent (PR_SET_PDEATHSIG), so killing the runner leaves no orphan that could record
a run behind a rerun's back. A killed child leaves nothing: the store writes a run in one
transaction. The cell's log is appended to, each attempt under a header naming its runner, so
a retry or another runner never overwrites an earlier attempt's log.
"""
from __future__ import annotations

import copy
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from memstudy.config import RunConfig, load_toml
from memstudy.errors import ConfigError
from memstudy.grid import forkserver
from memstudy.grid.spec import config_hash
from memstudy.runner import resolved, run_name
from memstudy.store import ResultsDB, RunRecord

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


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _child_setup(parent: int) -> None:
    """In the child, before exec: die with the runner (PR_SET_PDEATHSIG), so killing the
    runner kills its cells and no orphan records a run behind a rerun's back."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the runner died before prctl took effect
            os._exit(1)


class CellProcess:
    """A running `memstudy run` child in its own process group, with its log file."""

    def __init__(self, config: RunConfig, db_path: str | Path, gpu: str | None = None):
        self.config, self.db_path, self.gpu = config, str(db_path), gpu
        folder = cells_folder(db_path)
        toml = write_cell_config(config, folder)
        self.hash = config_hash(config)
        self.log_path = folder / f"{self.hash}.log"
        self.before = _last_run_id(ResultsDB(db_path), self.hash)  # earlier attempts' runs
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        # progress lines go to the cell's log: `tail -f` it to follow a long cell
        cmd = [sys.executable, "-m", "memstudy", "--db", self.db_path, "run", "--config", str(toml)]
        parent = os.getpid()
        with open(self.log_path, "a") as log:  # one header per attempt: logs are never overwritten
            log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} attempt by the runner "
                      f"{socket.gethostname()} pid {parent}: {' '.join(cmd)}\n")
        if (server := forkserver.server()) is not None:  # imports paid once (grid/forkserver.py)
            cells = {"MEMSTUDY_CACHE": str(folder / "phantoms")}  # phantoms made once per grid
            self.proc = server.popen(cmd[1:], {**cells, **env}, self.log_path)
            self.started = time.time()
            return
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True,
                                         preexec_fn=lambda: _child_setup(parent))
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

    def finish(self, timed_out: bool = False) -> str:
        """The cell's outcome: its recorded status, 'timeout' (recorded here), or killed/crashed."""
        db = ResultsDB(self.db_path)
        rows = db.query("SELECT status, failed_phase FROM runs WHERE config_hash = ? AND id > ? "
                        "ORDER BY id DESC LIMIT 1", (self.hash, self.before))
        if rows:
            r = rows[0]
            return r["status"] + (f" in {r['failed_phase']}" if r["failed_phase"] else "")
        if timed_out:
            record_timeout(db, self.config, self.hash, self.started, self.gpu)
            return "error in timeout"
        rc = self.proc.returncode
        return f"{KILLED} by signal {-rc}" if rc < 0 else f"{CRASHED} (exit {rc}, see {self.log_path})"


def record_timeout(db: ResultsDB, config: RunConfig, key: str, started: float,
                   gpu: str | None) -> None:
    info = {"host": os.uname().nodename, "device": config.train.device, "gpu_slot": gpu}
    name = run_name(config)
    config = resolved(copy.deepcopy(config))  # stored like every run: canonical techniques
    db.record(RunRecord(config=config.to_dict(), config_hash=key, name=name,
                        status="error", env=info, started_at=started, label=config.label,
                        failed_phase="timeout",
                        error=f"cell exceeded its timeout of {time.time() - started:.0f} s and "
                              "was killed; run it again with a longer timeout: memstudy grid "
                              "SPEC --retry timeout --timeout SECONDS"))


def _last_run_id(db: ResultsDB, key: str) -> int:
    rows = db.query("SELECT MAX(id) AS id FROM runs WHERE config_hash = ?", (key,))
    return rows[0]["id"] or 0


def run_isolated(config: RunConfig, db_path: str | Path, timeout_s: float | None = None,
                 gpu: str | None = None, poll_s: float = 0.1) -> str:
    """Run one configuration in its own process and wait; returns its outcome."""
    child = CellProcess(config, db_path, gpu)
    try:
        while child.poll() is None:
            if timeout_s is not None and time.time() - child.started > timeout_s:
                child.kill()
                return child.finish(timed_out=True)
            time.sleep(poll_s)
    except BaseException:
        child.kill()
        raise
    return child.finish()
