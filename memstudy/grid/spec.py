"""Grid spec files: load, expand into cells, validate every cell before any runs (docs/grid.md)."""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memstudy.byte_sizes import ByteSize
from memstudy.config import RunConfig, from_dict, read_toml, split_techniques
from memstudy.errors import ConfigError
from memstudy.runner import config_hash, run_name
from memstudy.image_sizes import check_input_fits, parse_size
from memstudy.typecheck import check_fields

SPEC_KEYS = {"name", "techniques", "product", "image_sizes", "batch_sizes", "seeds", "world_sizes",
             "encoders", "epochs", "steps", "data", "budget", "timeout_s", "base"}
KILLED = "killed"  # outcomes that leave no record: a rerun runs the cell again
CRASHED = "crashed"

@dataclass
class GridSpec:
    name: str = "grid"
    technique_sets: list[list[str]] = field(default_factory=lambda: [[]])
    image_sizes: list[int | str] = field(default_factory=lambda: [256])  # canonical sizes
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    seeds: list[int] = field(default_factory=lambda: [0])
    world_sizes: list[int | None] = field(default_factory=lambda: [None])  # None: [base]'s
    encoders: list[str | None] = field(default_factory=lambda: [None])  # model.encoder; None:
    # [base]'s (a grid compares networks as it compares technique sets)
    epochs: int | None = None
    steps: int | None = None
    data: str | None = None  # 'synthetic' or a folder of radiographs
    budget: ByteSize | None = None
    timeout_s: float | None = None
    base: dict[str, Any] = field(default_factory=dict)  # RunConfig settings shared by all cells


@dataclass
class Cell:
    index: int
    config: RunConfig
    hash: str | None = None
    error: str | None = None  # why the cell is invalid; invalid cells never run
    gpus: int = 0  # GPUs the cell holds while it runs (gpus_needed); 0 on the CPU

    @property
    def name(self) -> str:
        return run_name(self.config)

    def describe(self) -> str:
        t = self.config.train
        ws = self.config.world_size
        return (f"{self.name} {t.image_size}px batch {t.batch_size} seed {t.seed}"
                + (f" world_size {ws}" if ws > 1 else ""))


def load_spec(path: str | Path) -> GridSpec:
    return spec_from_dict(read_toml(path, "grid spec"), default_name=Path(path).stem)


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
    for key in ("image_sizes", "batch_sizes", "seeds", "world_sizes", "encoders"):
        if key in raw:
            # sizes: 4188, "4188x3500" or "native", as train.image_size (memstudy/image_sizes.py)
            kind = {"image_sizes": (int, str), "encoders": str}.get(key, int)
            setattr(spec, key, _list(raw, key, kind))
            if not getattr(spec, key):
                raise ConfigError(f"grid {key} is empty; list at least one value")
    check_fields(spec, "grid ")  # epochs, steps, data, budget, timeout_s, base: declared types
    spec.image_sizes = [parse_size(s, "grid image_sizes entry") for s in spec.image_sizes]
    if any(ws < 1 for ws in spec.world_sizes if ws is not None):
        raise ConfigError(f"grid world_sizes must be >= 1 (got {spec.world_sizes})")
    if spec.epochs is not None and spec.steps is not None:
        raise ConfigError("grid sets both epochs and steps; keep one (steps caps all epochs)")
    if spec.timeout_s is not None and not (isinstance(spec.timeout_s, (int, float)) and spec.timeout_s > 0):
        raise ConfigError(f"grid timeout_s must be a positive number of seconds (got {spec.timeout_s!r})")
    return spec


def _list(raw: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> list:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ConfigError(f"grid {key} must be a list of {names} (got {value!r})")
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
    from memstudy.train import check_measurable

    cells: list[Cell] = []
    seen: set[str] = set()
    combos = itertools.product(spec.encoders, spec.world_sizes, spec.technique_sets,
                               spec.image_sizes, spec.batch_sizes, spec.seeds)
    for encoder, world, techniques, size, batch, seed in combos:
        cfg = cell_config(spec, techniques, size, batch, seed, world, encoder)
        cell = Cell(index=len(cells) + 1, config=cfg)
        try:
            cell.gpus = make_plan(copy.deepcopy(cfg)).gpus_needed()
            check_input_fits(cfg.train.image_size, cfg.train.batch_size)  # never a run
            if cfg.data.source == "synthetic":  # a folder's size is known only once it is read
                check_measurable(cfg, cfg.data.train_images)
            cell.hash = config_hash(cfg)
        except (ConfigError, ValueError) as exc:
            cell.error = str(exc)
        if cell.hash is None or cell.hash not in seen:
            seen.add(cell.hash or f"invalid{cell.index}")
            cells.append(cell)
    for i, cell in enumerate(cells, 1):
        cell.index = i
    return cells


def gpus_needed(config: RunConfig) -> int:
    """The GPUs a cell of `config` needs at once (Plan.gpus_needed, from the techniques'
    declared gpus_per_process); raises ConfigError if it is invalid."""
    from memstudy.techniques.compose import make_plan

    return make_plan(copy.deepcopy(config)).gpus_needed()


def cell_config(spec: GridSpec, techniques: list[str], size: int | str, batch: int, seed: int,
                world_size: int | None = None, encoder: str | None = None) -> RunConfig:
    cfg = from_dict(copy.deepcopy(spec.base))
    cfg.techniques = list(techniques)
    if encoder is not None:  # an encoders entry; None keeps [base.model]'s
        cfg.model.encoder = encoder
    if world_size is not None:  # a world_sizes entry; None keeps [base] world_size
        cfg.world_size = world_size
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


def cell_table(cells: list[Cell], outcomes: dict[int, str]) -> str:
    from memstudy.text_table import format_table

    rows = [[c.index, c.name, c.config.train.image_size, c.config.train.batch_size,
             c.config.train.seed, c.config.world_size, c.gpus, c.hash or "-",
             outcomes.get(c.index, "-")] for c in cells]
    return format_table(["cell", "techniques", "px", "batch", "seed", "world", "gpus", "hash",
                         "outcome"], rows)


def plan_outcomes(cells: list[Cell], db, retry: frozenset[str] = frozenset()) -> dict[int, str]:
    """What a run would do with each cell (for --dry-run), with --retry `retry`."""
    from memstudy.grid.claims import Runner, attempt_kind, latest_attempts, wants_rerun

    from memstudy.grid.history import older_records

    attempts, now = latest_attempts(db), Runner.this_process()
    older = older_records(cells, db)
    outcomes = {}
    for c in cells:
        last = attempts.get(c.hash)
        if c.error:
            outcomes[c.index] = f"invalid: {c.error}"
        elif not wants_rerun(last, retry, now):
            outcomes[c.index] = "recorded (skip)"
        else:
            outcomes[c.index] = ("to run" if last is None else
                                 f"to run again (last: {attempt_kind(last['status'], last['failed_phase'])})")
            if c.index in older:
                outcomes[c.index] += f"; {older[c.index]}"
    return outcomes
