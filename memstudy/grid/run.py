"""Running a grid: every valid, unrecorded cell in its own process, one per GPU at a time."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from memstudy.grid.cells import CRASHED, KILLED, CellProcess
from memstudy.grid.spec import Cell, GridSpec, expand
from memstudy.store import ResultsDB

@dataclass
class GridResult:
    cells: list[Cell]
    outcomes: dict[int, str] = field(default_factory=dict)  # cell index -> outcome

    @property
    def unrecorded(self) -> list[int]:
        return [i for i, o in self.outcomes.items() if o.startswith((KILLED, CRASHED))]


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries for the children."""
    import torch

    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [g.strip() for g in listed.split(",") if g.strip()] if listed else []
    return ids[:torch.cuda.device_count()] or [str(i) for i in range(torch.cuda.device_count())]


def run_grid(spec: GridSpec, db_path: str | Path, gpus: list[str] | None = None,
             progress: Callable[[str], None] | None = None, poll_s: float = 0.2) -> GridResult:
    """Run every valid, unrecorded cell; one per GPU at a time (one at a time on the CPU)."""
    progress = progress or (lambda _msg: None)
    cells = expand(spec)
    result = GridResult(cells)
    recorded = ResultsDB(db_path).recorded_hashes()
    todo = []
    for cell in cells:
        if cell.error:
            result.outcomes[cell.index] = f"invalid: {cell.error}"
            progress(f"[{cell.index}/{len(cells)}] invalid, not run: {cell.describe()}: {cell.error}")
        elif cell.hash in recorded:
            result.outcomes[cell.index] = "recorded earlier (skipped)"
        else:
            todo.append(cell)
    uses_gpu = any(c.config.train.device != "cpu" for c in todo)
    slots: list[str | None] = (gpus if gpus else visible_gpus() if uses_gpu else []) or [None]
    _Scheduler(result, todo, slots, db_path, spec.timeout_s, progress, poll_s).run()
    return result


class _Scheduler:
    def __init__(self, result, todo, slots, db_path, timeout_s, progress, poll_s):
        self.result, self.todo, self.slots = result, list(todo), slots
        self.db_path, self.timeout_s, self.progress, self.poll_s = db_path, timeout_s, progress, poll_s
        self.running: dict[str | None, tuple[Cell, CellProcess]] = {}
        self.durations: list[float] = []
        self.t0, self.total = time.time(), len(result.cells)

    def run(self) -> None:
        try:
            while self.todo or self.running:
                for slot in [s for s in self.slots if s not in self.running]:
                    if self.todo:
                        self._start(slot, self.todo.pop(0))
                self._reap()
                time.sleep(self.poll_s)
        except BaseException:  # Ctrl-C, SIGTERM: kill the cells; they leave no record
            for cell, child in self.running.values():
                child.kill()
                self.result.outcomes[cell.index] = f"{KILLED} (runner interrupted)"
            raise

    def _start(self, slot: str | None, cell: Cell) -> None:
        self.running[slot] = (cell, CellProcess(cell.config, self.db_path, slot))
        where = f" on GPU {slot}" if slot is not None else ""
        self.progress(f"[{cell.index}/{self.total}] {cell.describe()}{where} | "
                      f"elapsed {_hms(time.time() - self.t0)} | left {self._eta()}")

    def _reap(self) -> None:
        for slot, (cell, child) in list(self.running.items()):
            running = child.poll() is None
            late = running and self.timeout_s is not None and time.time() - child.started > self.timeout_s
            if running and not late:
                continue
            if late:
                child.kill()
            outcome = child.finish(timed_out=late)
            del self.running[slot]
            self.durations.append(time.time() - child.started)
            self.result.outcomes[cell.index] = outcome
            self.progress(f"[{cell.index}/{self.total}] {cell.name} {cell.config.train.image_size}px: "
                          f"{outcome} ({self.durations[-1]:.1f} s)")

    def _eta(self) -> str:
        if not self.durations:
            return "?"
        left = len(self.todo) + len(self.running)
        mean = sum(self.durations) / len(self.durations)
        return "~" + _hms(mean * left / len(self.slots))


def _hms(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
