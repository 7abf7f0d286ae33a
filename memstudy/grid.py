"""Grids of technique combinations x image sizes x batch sizes x seeds: `memstudy grid SPEC`.

Every cell is expanded and validated (`make_plan`) before any runs; an invalid cell is
reported with its reason and never run. Each valid cell runs in its own process
(`python -m memstudy run --config <cell>.toml`), so one cell's memory state or crash cannot
touch another: one cell per GPU at a time (CUDA_VISIBLE_DEVICES per child), one at a time on
the CPU. Resuming is by config hash: a cell whose hash is recorded is skipped.

Killing is safe because the store writes a run in one transaction: a cell killed mid-run
(by its timeout, by SIGKILL, or with the runner on Ctrl-C / SIGKILL, since children die
with their parent) leaves nothing, and a rerun runs it again. A cell that exceeds its
timeout is recorded as status 'error', failed_phase 'timeout'. docs/grid.md has the format.
"""
from __future__ import annotations

import copy
import ctypes
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from memstudy.config import RunConfig, from_dict, load_toml, split_techniques
from memstudy.errors import ConfigError
from memstudy.runner import resolved, run_name
from memstudy.store import ResultsDB, RunRecord

SPEC_KEYS = {"name", "techniques", "product", "image_sizes", "batch_sizes", "seeds", "epochs",
             "steps", "data", "budget", "timeout_s", "base"}
KILLED = "killed"  # outcomes that leave no record: a rerun runs the cell again
CRASHED = "crashed"


@dataclass
class GridSpec:
    name: str = "grid"
    technique_sets: list[list[str]] = field(default_factory=lambda: [[]])
    image_sizes: list[int] = field(default_factory=lambda: [256])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    seeds: list[int] = field(default_factory=lambda: [0])
    epochs: int | None = None
    steps: int | None = None
    data: str | None = None  # 'synthetic' or a folder of radiographs
    budget: str | None = None
    timeout_s: float | None = None
    base: dict[str, Any] = field(default_factory=dict)  # RunConfig settings shared by all cells


@dataclass
class Cell:
    index: int
    config: RunConfig
    hash: str | None = None
    error: str | None = None  # why the cell is invalid; invalid cells never run

    @property
    def name(self) -> str:
        return run_name(self.config)

    def describe(self) -> str:
        t = self.config.train
        return f"{self.name} {t.image_size}px batch {t.batch_size} seed {t.seed}"


def load_spec(path: str | Path) -> GridSpec:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"grid spec {str(path)!r} not found")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return spec_from_dict(raw, default_name=path.stem)


def spec_from_dict(raw: dict[str, Any], default_name: str = "grid") -> GridSpec:
    unknown = set(raw) - SPEC_KEYS
    if unknown:
        raise ConfigError(f"unknown grid key(s) {sorted(unknown)}; valid: {sorted(SPEC_KEYS)}")
    sets = [split_techniques(s) for s in _list(raw, "techniques", str)]
    sets += product_sets(raw.get("product", {}))
    if not sets:
        sets = [[]]
    unique = list({tuple(s): s for s in sets}.values())  # same set listed twice runs once
    spec = GridSpec(name=raw.get("name", default_name), technique_sets=unique,
                    epochs=raw.get("epochs"), steps=raw.get("steps"), data=raw.get("data"),
                    budget=raw.get("budget"), timeout_s=raw.get("timeout_s"),
                    base=raw.get("base", {}))
    for key in ("image_sizes", "batch_sizes", "seeds"):
        if key in raw:
            setattr(spec, key, _list(raw, key, int))
            if not getattr(spec, key):
                raise ConfigError(f"grid {key} is empty; list at least one value")
    if spec.epochs is not None and spec.steps is not None:
        raise ConfigError("grid sets both epochs and steps; keep one (steps caps all epochs)")
    if spec.timeout_s is not None and not (isinstance(spec.timeout_s, (int, float)) and spec.timeout_s > 0):
        raise ConfigError(f"grid timeout_s must be a positive number of seconds (got {spec.timeout_s!r})")
    return spec


def _list(raw: dict[str, Any], key: str, kind: type) -> list:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
        raise ConfigError(f"grid {key} must be a list of {kind.__name__} (got {value!r})")
    return value


def product_sets(product: dict[str, list[str]]) -> list[list[str]]:
    """{'amp': ['off', 'bf16'], 'checkpoint': ['off', 'on']} -> [[], ['checkpoint'], ['amp:bf16'], ...].

    'off' leaves the technique out, 'on' uses its defaults, anything else is its option
    string (`sqrt`, `placement=sqrt:segments=4`)."""
    if not isinstance(product, dict):
        raise ConfigError("grid [product] must be a table: technique = [options]")
    choices = []
    for name, options in product.items():
        if not isinstance(options, list) or not options:
            raise ConfigError(f"grid product.{name} must be a non-empty list, e.g. ['off', 'on']")
        choices.append([None if o == "off" else name if o == "on" else f"{name}:{o}" for o in options])
    return [[t for t in combo if t] for combo in itertools.product(*choices)] if choices else []


def expand(spec: GridSpec) -> list[Cell]:
    """Every cell of the grid, validated; an invalid cell carries its reason."""
    from memstudy.techniques.compose import make_plan  # torch-heavy: only when expanding

    cells: list[Cell] = []
    seen: set[str] = set()
    combos = itertools.product(spec.technique_sets, spec.image_sizes, spec.batch_sizes, spec.seeds)
    for techniques, size, batch, seed in combos:
        cfg = cell_config(spec, techniques, size, batch, seed)
        cell = Cell(index=len(cells) + 1, config=cfg)
        try:
            make_plan(cfg)
            cell.hash = config_hash(cfg)
        except (ConfigError, ValueError) as exc:
            cell.error = str(exc)
        if cell.hash is None or cell.hash not in seen:
            seen.add(cell.hash or f"invalid{cell.index}")
            cells.append(cell)
    for i, cell in enumerate(cells, 1):
        cell.index = i
    return cells


def cell_config(spec: GridSpec, techniques: list[str], size: int, batch: int, seed: int) -> RunConfig:
    cfg = from_dict(copy.deepcopy(spec.base))
    cfg.techniques = list(techniques)
    cfg.train.image_size, cfg.train.batch_size = size, batch
    cfg.train.seed = cfg.data.seed = seed  # as `memstudy run --seed` does
    if spec.epochs is not None:
        cfg.train.epochs = spec.epochs
    if spec.steps is not None:
        cfg.train.max_steps = spec.steps
    if spec.data is not None:
        cfg.data.source, cfg.data.path = (("synthetic", None) if spec.data == "synthetic"
                                          else ("folder", spec.data))
    if spec.budget is not None:
        cfg.budget = spec.budget
    cfg.label = cfg.label or spec.name
    return cfg


# -- one cell in its own process ---------------------------------------------------------------
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


def config_hash(config: RunConfig) -> str:
    """The hash a run of `config` is recorded under (techniques in canonical form)."""
    return resolved(copy.deepcopy(config)).hash()


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
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        cmd = [sys.executable, "-m", "memstudy", "--db", self.db_path, "run", "--config",
               str(toml), "-q"]
        parent = os.getpid()
        with open(self.log_path, "w") as log:
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
        rows = db.query("SELECT status, failed_phase FROM runs WHERE config_hash = ? "
                        "ORDER BY id DESC LIMIT 1", (self.hash,))
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
                              "was killed; raise timeout_s in the grid spec"))


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


# -- the grid ----------------------------------------------------------------------------------
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


def cell_table(cells: list[Cell], outcomes: dict[int, str]) -> str:
    from memstudy.tables import format_table

    rows = [[c.index, c.name, c.config.train.image_size, c.config.train.batch_size,
             c.config.train.seed, c.hash or "-", outcomes.get(c.index, "-")] for c in cells]
    return format_table(["cell", "techniques", "px", "batch", "seed", "hash", "outcome"], rows)


def plan_outcomes(cells: list[Cell], recorded: set[str]) -> dict[int, str]:
    """What a run would do with each cell (for --dry-run)."""
    return {c.index: f"invalid: {c.error}" if c.error else
            "recorded (skip)" if c.hash in recorded else "to run" for c in cells}
