"""`memstudy tune`: evolutionary, asynchronous hyperparameter search with Propulate (seeds/004
chapter 6) over technique options and training settings; every trial is a recorded run.

Spec (TOML, docs/tune.md):

    [base]                      # a run config, as for `memstudy run --config`
    techniques = ["lowrank"]
    [base.train]
    image_size = 512
    [space]                     # "<section or technique>.<name>" = range or choices
    "train.lr" = [1e-4, 1e-2]   # two numbers: a float range (two ints: an int range)
    "lowrank.beta" = [0.05, 0.5]
    "train.optimizer" = ["adam", "adamw"]   # strings: categorical
    [search]
    generations = 8             # trials per worker (Propulate's generations)
    pop_size = 4
    seed = 0
    [fitness]
    metric = "val_loss"         # last epoch's validation loss (1 - MS-SSIM), minimised
    memory_budget = "8GiB"      # optional

Fitness (minimised), a function of recorded figures only:
- status ok, within the budget (or none): the metric of the last epoch (rank 0): in [0, 1];
- status ok, peak memory above the budget: 1 + peak / budget (every such trial ranks behind
  every trial within the budget, smaller overshoots first); peak memory is the run's
  `alloc_peak_total_bytes` on a GPU, the largest `tensor_start_bytes + tensor_peak_bytes` of a
  phase on the CPU (docs/metrics.md);
- oom, diverged, error: +inf.

Resumable: a trial whose resolved config hash is already in the database is not re-run; its
recorded figures give the fitness. Islands: one Propulate worker per MPI rank
(`mpirun -n N memstudy tune ...`); rank r trains on GPU r mod (visible GPUs).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from memstudy.config import RunConfig, from_dict, read_toml
from memstudy.errors import ConfigError
from memstudy.bytesize import parse_bytes

SETTING_SECTIONS = ("train", "data")
TUNE_LABEL = "tune"


@dataclass
class TuneSpec:
    base: dict[str, Any]
    space: dict[str, tuple]  # key -> (lo, hi) numbers or a tuple of strings
    generations: int = 4
    pop_size: int = 4
    seed: int = 0
    metric: str = "val_loss"
    memory_budget: str | None = None
    checkpoint: str = "tune-checkpoints"
    islands: int = 1


def load_spec(path: str) -> TuneSpec:
    raw = read_toml(path, "tune spec")
    return parse_spec(raw)


def parse_spec(raw: dict[str, Any]) -> TuneSpec:
    unknown = set(raw) - {"base", "space", "search", "fitness"}
    if unknown:
        raise ConfigError(f"tune spec: unknown table(s) {sorted(unknown)}; valid: base, space, "
                          "search, fitness")
    space = {k: _dimension(k, v) for k, v in raw.get("space", {}).items()}
    search, fit = raw.get("search", {}), raw.get("fitness", {})
    for table, given, valid in (("search", search, {"generations", "pop_size", "seed", "checkpoint",
                                                    "islands"}),
                                ("fitness", fit, {"metric", "memory_budget"})):
        bad = set(given) - valid
        if bad:
            raise ConfigError(f"tune spec: unknown key(s) {sorted(bad)} in [{table}]; valid: "
                              f"{sorted(valid)}")
    spec = TuneSpec(base=raw.get("base", {}), space=space, **search, **fit)
    check_spec(spec)
    return spec


def _dimension(key: str, value: Any) -> tuple:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"tune space {key!r}: give [low, high] or a list of choices")
    if all(isinstance(v, str) for v in value):
        return tuple(value)
    if len(value) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                  for v in value):
        raise ConfigError(f"tune space {key!r} = {value}: a range is two numbers [low, high]")
    lo, hi = value
    if not lo < hi:
        raise ConfigError(f"tune space {key!r}: low {lo} must be below high {hi}")
    if isinstance(lo, int) and isinstance(hi, int):
        return (int(lo), int(hi))
    return (float(lo), float(hi))


def check_spec(spec: TuneSpec) -> None:
    """Everything refusable, refused before any trial runs: empty space, unknown names, bad
    values at the corners of the space, bad search settings."""
    from memstudy.techniques import get_technique
    from memstudy.techniques.compose import make_plan

    if not spec.space:
        raise ConfigError("tune spec: [space] is empty; give at least one setting to search, "
                          "e.g. \"train.lr\" = [1e-4, 1e-2]")
    for name in ("generations", "pop_size", "islands"):
        if getattr(spec, name) < 1:
            raise ConfigError(f"tune spec: [search] {name} must be >= 1 (got {getattr(spec, name)})")
    if spec.metric not in ("val_loss", "train_loss"):
        raise ConfigError(f"tune spec: [fitness] metric {spec.metric!r}: use val_loss or train_loss")
    if spec.memory_budget is not None:
        try:
            parse_bytes(spec.memory_budget, "memory_budget")
        except ValueError as exc:
            raise ConfigError(f"tune spec: [fitness] {exc}") from None
    base = base_config(spec)
    chosen = [t.split(":")[0] for t in base.techniques]
    for key in spec.space:
        section, _, name = key.partition(".")
        if not name:
            raise ConfigError(f"tune space {key!r}: write <section or technique>.<name>, "
                              "e.g. train.lr or lowrank.beta")
        if section in SETTING_SECTIONS:
            valid = {f.name for f in dataclasses.fields(getattr(base, section))}
            if name not in valid:
                raise ConfigError(f"tune space {key!r}: [{section}] has no setting {name!r}; "
                                  f"valid: {sorted(valid)}")
            continue
        if section not in chosen:
            raise ConfigError(f"tune space {key!r}: technique {section!r} is not in [base] "
                              f"techniques {base.techniques}; add it there or fix the name")
        options = {f.name for f in dataclasses.fields(get_technique(section).options)}
        if name not in options:
            raise ConfigError(f"tune space {key!r}: technique {section} has no option {name!r}; "
                              f"options: {sorted(options)}")
    for corner in ("low", "high"):  # refused values at either end stop the search up front
        params = {k: (v[0] if corner == "low" else v[-1]) for k, v in spec.space.items()}
        make_plan(trial_config(spec, params))


def base_config(spec: TuneSpec) -> RunConfig:
    cfg = from_dict(copy.deepcopy(spec.base))
    cfg.label = TUNE_LABEL
    return cfg


def trial_config(spec: TuneSpec, params: dict[str, Any]) -> RunConfig:
    cfg = base_config(spec)
    for key, value in params.items():
        section, _, name = key.partition(".")
        if section in SETTING_SECTIONS:
            setattr(getattr(cfg, section), name, value)
            continue
        for i, tech in enumerate(cfg.techniques):
            tech_name, *args = tech.split(":")
            if tech_name == section:
                args = [a for a in args if a.partition("=")[0] != name]  # the trial's value wins
                cfg.techniques[i] = ":".join([tech_name, *args, f"{name}={value}"])
    return cfg


def config_hash(cfg: RunConfig) -> str:
    from memstudy.runner import resolved

    return resolved(copy.deepcopy(cfg)).hash()


def recorded_figures(db, digest: str) -> dict[str, Any] | None:
    """The latest recorded run of this config: status, last-epoch losses (rank 0), peak bytes."""
    runs = db.query("SELECT id, status FROM runs WHERE config_hash = ? ORDER BY id DESC LIMIT 1",
                    (digest,))
    if not runs:
        return None
    run_id, status = runs[0]["id"], runs[0]["status"]
    epochs = [e for e in db.epochs(run_id) if e["rank"] == 0]
    metrics = db.metrics(run_id)
    return {"status": status, "run_id": run_id,
            "val_loss": epochs[-1]["val_loss"] if epochs else None,
            "train_loss": epochs[-1]["train_loss"] if epochs else None,
            "peak_bytes": peak_bytes(metrics)}


def peak_bytes(metrics: dict[tuple[int, str], dict[str, float]]) -> float | None:
    run = metrics.get((0, "run"), {})
    if "alloc_peak_total_bytes" in run:
        return run["alloc_peak_total_bytes"]
    phases = [m["tensor_start_bytes"] + m["tensor_peak_bytes"] for (rank, _), m in metrics.items()
              if rank == 0 and "tensor_peak_bytes" in m]
    return max(phases) if phases else None


def fitness(figures: dict[str, Any], metric: str, budget_bytes: int | None) -> float:
    """The module docstring's fitness, from recorded figures only."""
    value = figures.get(metric)
    if figures["status"] != "ok" or value is None or not math.isfinite(value):
        return math.inf
    peak = figures.get("peak_bytes")
    if budget_bytes is not None and peak is not None and peak > budget_bytes:
        return 1.0 + peak / budget_bytes
    return float(value)


class Trials:
    """Runs (or finds recorded) trials; the loss function Propulate calls."""

    def __init__(self, spec: TuneSpec, db, progress: Callable[[str], None] | None = None,
                 device: str | None = None):
        self.spec, self.db, self.progress, self.device = spec, db, progress, device
        self.budget = parse_bytes(spec.memory_budget, "memory_budget") if spec.memory_budget else None
        self.ran: list[str] = []  # hashes trained by this process
        self.reused: list[str] = []  # hashes found recorded

    def __call__(self, params: dict[str, Any]) -> float:
        from memstudy.runner import execute

        params = {k: _cast(self.spec.space[k], v) for k, v in dict(params).items()
                  if k in self.spec.space}
        cfg = trial_config(self.spec, params)
        if self.device is not None:
            cfg.train.device = self.device
        digest = config_hash(cfg)
        figures = recorded_figures(self.db, digest)
        if figures is None:
            execute(cfg, self.db, self.progress)
            self.ran.append(digest)
            figures = recorded_figures(self.db, digest)
        else:
            self.reused.append(digest)
        value = fitness(figures, self.spec.metric, self.budget)
        if self.progress:
            self.progress(f"trial {params} -> run {figures['run_id']} {figures['status']} "
                          f"fitness {value:.4f}{' (recorded before)' if digest in self.reused else ''}")
        return value


def _cast(dim: tuple, value: Any) -> Any:
    if all(isinstance(v, str) for v in dim):
        return str(value)
    return int(round(value)) if isinstance(dim[0], int) else float(value)


def limits(spec: TuneSpec) -> dict[str, tuple]:
    return dict(spec.space)


def run_tune(spec: TuneSpec, db, progress: Callable[[str], None] | None = None) -> Trials:
    """Propulate over the MPI world: one worker per rank, `spec.islands` islands."""
    try:
        from mpi4py import MPI
        from propulate import Islands
        from propulate.utils import get_default_propagator
    except ImportError as exc:
        raise ConfigError(f"memstudy tune needs Propulate and an MPI library: pip install "
                          f"'memstudy[tune]' ({exc})") from None
    comm = MPI.COMM_WORLD
    if spec.islands > comm.size:
        raise ConfigError(f"tune spec: islands = {spec.islands} but only {comm.size} MPI "
                          f"process(es); start with mpirun -n {spec.islands} or lower islands")
    device = _rank_device(comm.rank)
    trials = Trials(spec, db, progress, device)
    rng = random.Random(spec.seed + comm.rank)
    propagator = get_default_propagator(spec.pop_size, limits(spec), rng=rng)
    os.makedirs(spec.checkpoint, exist_ok=True)
    islands = Islands(trials, propagator, rng, generations=spec.generations,
                      num_islands=spec.islands, checkpoint_path=spec.checkpoint,
                      migration_probability=0.9 if spec.islands > 1 else 0.0)
    islands.propulate()
    return trials


def _rank_device(rank: int) -> str | None:
    import torch

    if torch.cuda.is_available():
        return f"cuda:{rank % torch.cuda.device_count()}"
    return None
