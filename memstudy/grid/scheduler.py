"""Running a grid: every valid, unrecorded cell in its own process, on its own GPUs, each cell
claimed in the database first (memstudy.grid.claims), so runners sharing a database split the
cells between them instead of running each twice."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from memstudy.errors import ConfigError
import memstudy.grid.claims as claims
from memstudy.grid.cells import CRASHED, KILLED, CellProcess, cache_images
from memstudy.grid.claims import Holder, Runner
from memstudy.grid.history import older_records
from memstudy.grid.spec import Cell, GridSpec, expand
from memstudy.store import ResultsDB

ELSEWHERE = "not run here"  # outcome of a cell another runner has claimed

@dataclass
class GridResult:
    cells: list[Cell]
    outcomes: dict[int, str] = field(default_factory=dict)  # cell index -> outcome

    @property
    def unrecorded(self) -> list[int]:
        return [i for i, o in self.outcomes.items() if o.startswith((KILLED, CRASHED))]

    @property
    def failed(self) -> list[int]:
        """Cells this invocation ran that ended in error (a timeout included) or left no record;
        an oom or a divergence is a measurement, not a failure."""
        return [i for i, o in self.outcomes.items() if o.startswith("error")] + self.unrecorded

    @property
    def ran(self) -> list[int]:
        """Cells this invocation ran (not invalid, recorded earlier or run by another runner)."""
        return [i for i, o in self.outcomes.items()
                if not o.startswith(("invalid", "recorded earlier", ELSEWHERE, NOT_STARTED))]

    @property
    def not_started(self) -> list[int]:
        """Cells left for a later run: `start_within` had passed when their turn came."""
        return [i for i, o in self.outcomes.items() if o.startswith(NOT_STARTED)]


NOT_STARTED = "not started"


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries for the children."""
    import torch

    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [g.strip() for g in listed.split(",") if g.strip()] if listed else []
    return ids[:torch.cuda.device_count()] or [str(i) for i in range(torch.cuda.device_count())]


def run_grid(spec: GridSpec, db_path: str | Path, gpus: list[str] | None = None,
             progress: Callable[[str], None] | None = None, poll_s: float = 0.2,
             retry: frozenset[str] = frozenset(), per_gpu: int = 1,
             start_within: float | None = None) -> GridResult:
    """Run every valid, unrecorded cell (and those whose last attempt is of a kind in `retry`,
    e.g. {'error', 'timeout'}: a new attempt, the earlier one kept); each GPU cell on its own
    disjoint set of GPUs (as many as it needs: `gpus_needed`), or with `per_gpu` > 1 that
    many cells side by side on each GPU (their records say so: gpu_other_processes, and the
    reports leave their times out); CPU cells one at a time. With `start_within` (seconds) no
    cell starts after that much of the grid has passed; the running ones finish, and the rest
    are left for the same command to run later (a time slot used without killing a cell)."""
    progress = progress or (lambda _msg: None)
    runner = Runner.this_process()
    cells = expand(spec)
    check_sharing(cells, per_gpu)
    result = GridResult(cells)
    db = ResultsDB(db_path)
    attempts = claims.latest_attempts(db)
    pool = check_gpu_needs(cells, gpus)
    todo = []
    for cell in cells:
        if cell.error:
            result.outcomes[cell.index] = f"invalid: {cell.error}"
            progress(f"[{cell.index}/{len(cells)}] invalid, not run: {cell.describe()}: {cell.error}")
        elif not claims.wants_rerun(attempts.get(cell.hash), retry, runner):
            result.outcomes[cell.index] = "recorded earlier (skipped)"
        else:
            todo.append(cell)
    for index, why in older_records(todo, db).items():
        progress(f"[{index}/{len(cells)}] {why}")
    if cached := cache_images([cell.config for cell in todo], db_path):
        progress(cached)
    scheduler = _Scheduler(result, todo, GpuSlots(pool, per_gpu), db, spec.timeout_s, progress,
                           poll_s, runner, retry)
    scheduler.start_within = start_within
    scheduler.run()
    return result


def check_sharing(cells: list[Cell], per_gpu: int) -> None:
    """Cells may share a GPU (`per_gpu` > 1) only without a memory budget (a budget caps the
    allocator at the budget less the CUDA context, which it measures from the device's used
    memory, and the other cells' memory would be taken for context) and on one GPU each (a
    run on several GPUs does not record the other processes on them, so its times would
    pass for its own)."""
    if per_gpu < 1:
        raise ConfigError(f"--cells-per-gpu {per_gpu}: give 1 or more")
    if per_gpu == 1:
        return
    on_gpu = [c for c in cells if c.config.train.device != "cpu"]
    budgeted = [c for c in on_gpu if c.config.budget]
    if budgeted:
        first = budgeted[0]
        raise ConfigError(f"--cells-per-gpu {per_gpu} with a memory budget ({first.describe()}: "
                          f"budget {first.config.budget}): a budget measures the CUDA "
                          "context from the GPU's used memory, which cells beside it would add "
                          "to; run budgeted cells with --cells-per-gpu 1")
    several = [c for c in on_gpu if c.gpus > 1 or c.config.world_size > 1]
    if several:
        raise ConfigError(f"--cells-per-gpu {per_gpu} with cells on several GPUs "
                          f"({several[0].describe()}): "
                          "such runs do not record the other processes on their GPUs, so their "
                          "times would pass for their own; run them with --cells-per-gpu 1")


def check_gpu_needs(cells: list[Cell], gpus: list[str] | None) -> list[str]:
    """The GPU pool (--gpus, else the visible GPUs when a cell needs one); cells needing more
    GPUs than the pool holds are marked invalid, before anything runs."""
    uses_gpu = any(c.gpus for c in cells if not c.error)
    pool = gpus if gpus else visible_gpus() if uses_gpu else []
    for cell in cells:
        if not cell.error and cell.gpus > len(pool):
            cell.error = too_few_gpus(cell, pool, from_flag=bool(gpus))
    return pool


def too_few_gpus(cell: Cell, pool: list[str], from_flag: bool) -> str:
    ws = cell.config.world_size
    why = f"world_size {ws} runs one process per GPU" if ws > 1 else "mp:mode=local uses two GPUs"
    where = "--gpus lists" if from_flag else "the runner sees"
    return (f"needs {cell.gpus} GPUs at once ({why}) but {where} {len(pool)}; lower world_size "
            f"or give the grid more GPUs (--gpus, CUDA_VISIBLE_DEVICES)")


class GpuSlots:
    """Seats on GPUs for running cells: `per_gpu` cells at once on each GPU (1: a GPU is a
    cell's alone). A cell needing n GPUs takes a seat on n distinct GPUs (its
    CUDA_VISIBLE_DEVICES), those with the most free seats first, or waits; a CPU cell (n = 0)
    takes the single CPU slot, so CPU timings never compete with another CPU cell."""

    def __init__(self, gpus: list[str], per_gpu: int = 1):
        self.gpus, self.per_gpu = list(gpus), per_gpu
        self.seats = {g: per_gpu for g in self.gpus}  # free seats per GPU
        self.cpu_free = True

    def take(self, n: int) -> list[str] | None:
        """n GPU ids (the emptiest first, then in listed order), [] for the CPU slot, None if
        the cell must wait."""
        if n == 0:
            if not self.cpu_free:
                return None
            self.cpu_free = False
            return []
        free = sorted((g for g in self.gpus if self.seats[g]), key=lambda g: -self.seats[g])
        if n > len(free):
            return None
        taken = sorted(free[:n], key=self.gpus.index)
        for g in taken:
            self.seats[g] -= 1
        return taken

    def give(self, ids: list[str]) -> None:
        if not ids:
            self.cpu_free = True
            return
        if any(self.seats[g] == self.per_gpu for g in ids):
            raise RuntimeError(f"GPUs {ids} given back twice")
        for g in ids:
            self.seats[g] += 1

    @property
    def width(self) -> int:
        """Cells that can run at once (for the time-left estimate)."""
        return max(1, len(self.gpus) * self.per_gpu)


class _Scheduler:
    def __init__(self, result, todo, slots: GpuSlots, db: ResultsDB, timeout_s, progress, poll_s,
                 runner: Runner, retry: frozenset[str] = frozenset()):
        self.result, self.todo, self.slots = result, list(todo), slots
        self.db, self.timeout_s, self.progress, self.poll_s = db, timeout_s, progress, poll_s
        self.runner, self.retry = runner, retry
        self.running: list[tuple[Cell, CellProcess, list[str]]] = []
        self.durations: list[float] = []
        self.t0, self.total = time.time(), len(result.cells)
        self.beat = time.time()
        self.start_within: float | None = None

    def run(self) -> None:
        try:
            while self.todo or self.running:
                self._start_ready()
                self._reap()
                self._heartbeat()
                time.sleep(self.poll_s)
        except BaseException:  # Ctrl-C, SIGTERM: kill the cells; they leave no record
            for cell, child, _ids in self.running:
                child.kill()
                self.result.outcomes[cell.index] = f"{KILLED} (runner interrupted)"
            claims.release(self.db, [cell.hash for cell, _c, _i in self.running], self.runner)
            raise

    def _heartbeat(self) -> None:
        if self.running and time.time() - self.beat > claims.HEARTBEAT_S:
            claims.heartbeat(self.db, [cell.hash for cell, _c, _i in self.running], self.runner)
            self.beat = time.time()

    def _start_ready(self) -> None:
        """Start cells in spec order while the next one's GPUs are free. A cell that must wait
        holds back those behind it, so a 2-GPU cell is not starved by 1-GPU cells."""
        if self.start_within is not None and time.time() - self.t0 > self.start_within:
            self._leave_the_rest()
        while self.todo:
            ids = self.slots.take(self.todo[0].gpus)
            if ids is None:
                return
            cell = self.todo.pop(0)
            if self._claim(cell):
                self._start(cell, ids)
            else:
                self.slots.give(ids)

    def _leave_the_rest(self) -> None:
        for cell in self.todo:
            self.result.outcomes[cell.index] = f"{NOT_STARTED} (--start-within passed)"
        if self.todo:
            self.progress(f"{len(self.todo)} cells not started: --start-within "
                          f"{self.start_within:g} s has passed; the same command runs them")
        self.todo = []

    def _claim(self, cell: Cell) -> bool:
        """Claim the cell for this runner; otherwise say who has it, or that it is recorded."""
        taken = claims.claim(self.db, cell.hash, self.runner, self.retry)
        if taken is None:
            return True
        if isinstance(taken, Holder):
            outcome = f"{ELSEWHERE}: {taken}"
        else:
            outcome = "recorded by another runner (skipped)"
        self.result.outcomes[cell.index] = outcome
        self.progress(f"[{cell.index}/{self.total}] {cell.describe()}: {outcome}")
        return False

    def _start(self, cell: Cell, ids: list[str]) -> None:
        gpu = ",".join(ids) or None  # None: a CPU cell inherits the runner's environment
        threads = cell_threads(self.slots.width) if ids else None  # a CPU cell runs alone
        try:
            child = CellProcess(cell.config, self.db.path, gpu, threads)
        except BaseException:
            claims.release(self.db, [cell.hash], self.runner)
            self.slots.give(ids)
            raise
        self.running.append((cell, child, ids))
        where = f" on GPU{'s' if len(ids) > 1 else ''} {gpu}" if ids else ""
        self.progress(f"[{cell.index}/{self.total}] {cell.describe()}{where} | "
                      f"elapsed {_hms(time.time() - self.t0)} | left {self._eta()}")

    def _reap(self) -> None:
        for entry in list(self.running):
            cell, child, ids = entry
            running = child.poll() is None
            late = running and self.timeout_s is not None and time.time() - child.started > self.timeout_s
            if running and not late:
                continue
            if late:
                child.kill()
            try:
                outcome = child.finish(timed_out=late)
            finally:
                claims.release(self.db, [cell.hash], self.runner)
            self.running.remove(entry)
            self.slots.give(ids)
            self.durations.append(time.time() - child.started)
            self.result.outcomes[cell.index] = outcome
            took = child.times.describe() if child.times else f"{self.durations[-1]:.1f} s"
            self.progress(f"[{cell.index}/{self.total}] {cell.name} {cell.config.train.image_size}px: "
                          f"{outcome} ({took})")

    def _eta(self) -> str:
        if not self.durations:
            return "?"
        left = len(self.todo) + len(self.running)
        mean = sum(self.durations) / len(self.durations)
        return "~" + _hms(mean * left / self.slots.width)


def cell_threads(width: int, cores: int | None = None) -> int | None:
    """CPU threads for each GPU cell when `width` cells may run at once: the host's cores
    shared between them. torch gives every process all cores, and cells side by side can then
    spin OpenMP threads against each other and against the threads that launch the GPU's
    kernels (docs/testing.md: on the CPU, two processes of two threads on two cores ran 5x
    slower than of one). None: one cell at a time, or OMP_NUM_THREADS set, which they keep."""
    if width <= 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (cores or os.cpu_count() or 1) // width)


def _hms(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
