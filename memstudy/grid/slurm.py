"""Grids on a cluster: every cell one submitit job (Slurm, or submitit's local executor).

`memstudy grid SPEC --launcher slurm --partition gpu` submits one job per valid, unrecorded
cell, with the cell's GPU count (`gpus_needed`) and the spec's `timeout_s` as its time limit
(rounded up to whole minutes, as Slurm counts; a job the scheduler stops there is recorded as
a timeout by the launcher). The job is the cell's own process: it runs the cell's TOML with
`memstudy run`, as the local grid's child does, but into a small database of its own,
`<db>.cells/jobs/<hash>-<submitted>.sqlite`, never into the main one:
SQLite's locking is not safe on network filesystems, so the only writer of the main database
is the launching process, which merges each finished cell's database (store.merge_databases)
and then deletes it.

Resuming needs no bookkeeping beyond those files: a rerun first merges every cell database
that holds a run whose hash the main database lacks (cells that finished while no launcher
was watching), discards the others (a cell already merged: no duplicate), then submits what
is still unrecorded. Killing the launcher therefore loses no finished cell. On Ctrl-C the
launcher cancels the jobs it started (their cells leave nothing, as on one host); a job the
scheduler keeps running is merged by the next rerun if it finished by then.

The trade-off against the local scheduler (grid.scheduler): a job's queueing and start-up (seconds
on a quiet cluster, hours on a busy one) is paid per cell, in exchange for as many GPUs at
once as the cluster grants. Cells are identified by config hash, as everywhere.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

from memstudy.errors import ConfigError
from memstudy.grid.cells import CRASHED, KILLED, cells_folder, record_timeout, write_cell_config
from memstudy.grid.scheduler import GridResult
from memstudy.grid.spec import Cell, GridSpec, expand
from memstudy.store import ResultsDB, merge_databases, describe_outcome

LAUNCHERS = ("slurm", "submitit-local")


def run_cell(config_toml: str, cell_db: str) -> str:
    """The job's body, in the job's own process: what `memstudy --db CELL_DB run --config
    CELL.toml` does (one process, or one per rank for world_size > 1); returns the status."""
    from memstudy.config import load_toml
    from memstudy.launch_ranks import run_distributed
    from memstudy.runner import execute

    config = load_toml(config_toml)
    if config.world_size > 1:
        record = run_distributed(config, cell_db, None)
    else:
        record = execute(config, ResultsDB(cell_db))
    return record.status


def make_executor(launcher: str, folder: Path, partition: str | None):
    """A submitit executor for `launcher`, with clear errors for what is missing."""
    if launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher {launcher!r} unknown; choose one of {LAUNCHERS}")
    if launcher == "slurm" and not partition:
        raise ConfigError("--launcher slurm needs --partition (the Slurm partition to submit "
                          "to, e.g. --partition gpu; `sinfo` lists them)")
    try:
        import submitit
    except ImportError:
        raise ConfigError(f"--launcher {launcher} needs submitit: pip install submitit") from None
    if launcher == "slurm":
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
        executor.update_parameters(slurm_partition=partition)
        return executor
    return submitit.AutoExecutor(folder=folder, cluster="local")


def jobs_folder(db_path: str | Path) -> Path:
    """Where the jobs' files live: submitit's pickles and logs, the cells' own databases."""
    return cells_folder(db_path) / "jobs"


def cell_databases(db_path: str | Path, cell: Cell) -> list[Path]:
    return sorted(jobs_folder(db_path).glob(f"{cell.hash}-*.sqlite"))


def gather(db_path: str | Path, cell: Cell) -> str | None:
    """Merge the cell's finished database into the main one unless the main one has the cell
    already, delete the cell's databases, and return its recorded outcome (None: no record)."""
    main = ResultsDB(db_path)
    for path in cell_databases(db_path, cell):
        finished = cell.hash in ResultsDB(path).recorded_hashes()
        if finished and cell.hash not in main.recorded_hashes():  # one copy, never two
            merge_databases(db_path, [path])
    rows = main.query("SELECT status, failed_phase, trained FROM runs WHERE config_hash = ? "
                      "ORDER BY id DESC LIMIT 1", (cell.hash,))
    if not rows:
        return None
    for path in cell_databases(db_path, cell):  # merged, or a duplicate of a merged run
        for extra in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            extra.unlink(missing_ok=True)
    return describe_outcome(rows[0]["status"], rows[0]["failed_phase"], rows[0]["trained"])


def run_grid_submitit(spec: GridSpec, db_path: str | Path, launcher: str,
                      partition: str | None = None, max_jobs: int | None = None,
                      progress: Callable[[str], None] | None = None,
                      poll_s: float = 1.0) -> GridResult:
    """Run every valid, unrecorded cell as a submitit job (module docstring); at most
    `max_jobs` at once (None: all)."""
    progress = progress or (lambda _msg: None)
    executor = make_executor(launcher, jobs_folder(db_path), partition)
    cells = expand(spec)
    result = GridResult(cells)
    ResultsDB(db_path)  # create the main database before any job runs
    todo = []
    for cell in cells:
        if cell.error:
            result.outcomes[cell.index] = f"invalid: {cell.error}"
            progress(f"[{cell.index}/{len(cells)}] invalid, not run: {cell.describe()}: {cell.error}")
        elif (outcome := gather(db_path, cell)) is not None:
            result.outcomes[cell.index] = f"recorded earlier (skipped): {outcome}"
        else:
            todo.append(cell)
    _Jobs(executor, spec, db_path, result, progress, poll_s, max_jobs or len(todo) or 1).run(todo)
    return result


class _Jobs:
    """Submits cells as jobs (at most `width` at once) and gathers each as it ends."""

    def __init__(self, executor, spec: GridSpec, db_path, result: GridResult, progress,
                 poll_s: float, width: int):
        self.executor, self.spec, self.db_path, self.result = executor, spec, str(db_path), result
        self.progress, self.poll_s, self.width = progress, poll_s, width
        self.running: list[tuple[Cell, Any, float]] = []

    def run(self, todo: list[Cell]) -> None:
        todo = list(todo)
        try:
            while todo or self.running:
                while todo and len(self.running) < self.width:
                    self._submit(todo.pop(0))
                self._reap()
                time.sleep(self.poll_s)
        except BaseException:  # Ctrl-C, SIGTERM: cancel our jobs; finished cells are merged
            for cell, job, _t in self.running:
                job.cancel(check=False)
                self.result.outcomes[cell.index] = f"{KILLED} (launcher interrupted)"
            raise

    def _submit(self, cell: Cell) -> None:
        timeout_s = self.spec.timeout_s
        limit = {"timeout_min": math.ceil(timeout_s / 60)} if timeout_s else {}
        self.executor.update_parameters(name=f"memstudy-{cell.hash[:8]}", gpus_per_node=cell.gpus,
                                        tasks_per_node=1, nodes=1, **limit)
        toml = write_cell_config(cell.config, cells_folder(self.db_path))
        cell_db = jobs_folder(self.db_path) / f"{cell.hash}-{time.time_ns()}.sqlite"
        job = self.executor.submit(run_cell, str(toml), str(cell_db))
        self.running.append((cell, job, time.time()))
        self.progress(f"[{cell.index}/{len(self.result.cells)}] {cell.describe()}: job {job.job_id}"
                      + (f", {cell.gpus} GPU(s)" if cell.gpus else ""))

    def _reap(self) -> None:
        for entry in list(self.running):
            cell, job, started = entry
            if not job.done():
                continue
            self.running.remove(entry)
            outcome = gather(self.db_path, cell)
            if outcome is None:  # the job ended without its run: killed by the scheduler
                outcome = self._unrecorded(cell, job, started)
            self.result.outcomes[cell.index] = outcome
            self.progress(f"[{cell.index}/{len(self.result.cells)}] {cell.name} "
                          f"{cell.config.train.image_size}px: {outcome}")

    def _unrecorded(self, cell: Cell, job, started: float) -> str:
        if job.state.startswith("TIMEOUT") or (
                self.spec.timeout_s and time.time() - started >= self.spec.timeout_s):
            record_timeout(ResultsDB(self.db_path), cell.config, cell.hash, started,
                           f"job {job.job_id}")
            return "error in timeout"
        return f"{CRASHED} (job {job.job_id} {job.state}; see {job.paths.stderr})"
