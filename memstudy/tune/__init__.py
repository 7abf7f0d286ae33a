"""`memstudy tune`: evolutionary, asynchronous hyperparameter search with Propulate ([Coquelin] (docs/references.md)
chapter 6) over technique options and training settings; every trial is a recorded run.

Spec (TOML, docs/tune.md):

    [base]                      # a run config, as for `memstudy run --config`
    techniques = ["lowrank"]
    [base.train]
    image_size = 512
    [space]                     # "<section or technique>.<name>" = range or choices
    "train.lr" = [1e-4, 1e-2]   # two numbers: a float range (two ints: an int range)
    "lowrank.beta" = [0.05, 0.5]
    "tri_accel.tau_low" = {low = 1e-8, high = 1e-5, log = true}   # searched as log10
    "train.optimizer" = ["adam", "adamw"]   # strings: categorical
    [search]
    generations = 8             # trials per worker (Propulate's generations)
    pop_size = 4
    seed = 0
    [fitness]
    metric = "val_loss"         # or train_loss, or efficiency_score
    memory_budget = "8GiB"      # optional

Fitness (minimised), a function of recorded figures only:
- status ok, within the budget (or none): val_loss / train_loss: the last epoch's loss (rank 0),
  in [0, 1]; efficiency_score: minus Tri-Accel's efficiency score Q / (T * M) * 100
  (memstudy/techniques/tri_accel/score.py, [Tri-Accel] section 4.2), <= 0;
- status ok, peak memory above the budget: 1 + peak / budget (every such trial ranks behind
  every trial within the budget, smaller overshoots first); peak memory is the run's
  `alloc_peak_total_bytes` on a GPU, the largest `tensor_start_bytes + tensor_peak_bytes` of a
  phase on the CPU (docs/metrics.md);
- oom, diverged, error, or a trial config refused before it ran (nothing recorded): +inf.

Resumable: a trial whose resolved config hash is already in the database is not re-run; its
recorded figures give the fitness; Propulate's own population checkpoint (default: beside the
database, `<db>.propulate/`) lets a restarted search go on from its last generation. Islands:
one Propulate worker per MPI rank (`mpirun -n N memstudy tune ...`); rank r trains on GPU
r mod (visible GPUs). The Propulate driver (`run_tune`) is memstudy/tune/search.py; this
module needs neither Propulate nor MPI.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from memstudy.byte_sizes import parse_bytes
from memstudy.config import RunConfig, from_dict, read_toml
from memstudy.errors import ConfigError

SETTING_SECTIONS = ("train", "data")
TUNE_LABEL = "tune"
# metric -> sign: the fitness is sign * value, minimised (the efficiency score is maximised)
METRICS = {"val_loss": 1.0, "train_loss": 1.0, "efficiency_score": -1.0}


class LogRange(tuple):
    """A float range (low, high), 0 < low < high, that Propulate searches as log10: thresholds
    spanning orders of magnitude are sampled evenly per decade, not crowded at the top."""

    def __new__(cls, low: float, high: float):
        return super().__new__(cls, (float(low), float(high)))


@dataclass
class TuneSpec:
    base: dict[str, Any]
    space: dict[str, tuple]  # key -> (lo, hi) numbers, a LogRange, or a tuple of strings
    generations: int = 4
    pop_size: int = 4
    seed: int = 0
    metric: str = "val_loss"
    memory_budget: str | None = None
    checkpoint: str | None = None  # None: `<db>.propulate` beside the results database
    islands: int = 1


def load_tune_spec(path: str, plan_corners: bool = True) -> TuneSpec:
    raw = read_toml(path, "tune spec")
    return parse_spec(raw, plan_corners)


def parse_spec(raw: dict[str, Any], plan_corners: bool = True) -> TuneSpec:
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
    check_spec(spec, plan_corners)
    return spec


def _dimension(key: str, value: Any) -> tuple:
    if isinstance(value, dict):
        return _log_range(key, value)
    if not isinstance(value, list) or not value:
        raise ConfigError(f"tune space {key!r}: give [low, high], a list of choices or "
                          "{low = .., high = .., log = true}")
    if all(isinstance(v, str) for v in value):
        return tuple(value)
    if len(value) != 2 or not all(_is_number(v) for v in value):
        raise ConfigError(f"tune space {key!r} = {value}: a range is two numbers [low, high]")
    lo, hi = value
    if not lo < hi:
        raise ConfigError(f"tune space {key!r}: low {lo} must be below high {hi}")
    if isinstance(lo, int) and isinstance(hi, int):
        return (int(lo), int(hi))
    return (float(lo), float(hi))


def _log_range(key: str, value: dict[str, Any]) -> LogRange:
    if set(value) != {"low", "high", "log"} or value["log"] is not True:
        raise ConfigError(f"tune space {key!r} = {value}: a table is {{low = .., high = .., "
                          "log = true}} (a log10-scaled float range); otherwise write [low, high]")
    lo, hi = value["low"], value["high"]
    if not (_is_number(lo) and _is_number(hi) and 0 < lo < hi):
        raise ConfigError(f"tune space {key!r}: a log range needs 0 < low < high "
                          f"(got low {lo}, high {hi})")
    return LogRange(lo, hi)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_spec(spec: TuneSpec, plan_corners: bool = True) -> None:
    """Everything refusable, refused before any trial runs: empty space, unknown names, bad
    values at the corners of the space (`plan_corners`: planned on the spec's device; off for
    reading a recorded search, which needs no GPU), bad search settings."""
    from memstudy.techniques.compose import make_plan

    if not spec.space:
        raise ConfigError("tune spec: [space] is empty; give at least one setting to search, "
                          "e.g. \"train.lr\" = [1e-4, 1e-2]")
    for name in ("generations", "pop_size", "islands", "seed"):
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or (name != "seed" and value < 1):
            raise ConfigError(f"tune spec: [search] {name} must be an integer"
                              f"{'' if name == 'seed' else ' >= 1'} (got {value!r})")
    for name in ("checkpoint", "memory_budget"):
        if getattr(spec, name) is not None and not isinstance(getattr(spec, name), str):
            raise ConfigError(f"tune spec: {name} must be a string (got {getattr(spec, name)!r})")
    if spec.metric not in METRICS:
        raise ConfigError(f"tune spec: [fitness] metric {spec.metric!r}: use one of {list(METRICS)}")
    if spec.memory_budget is not None:
        try:
            parse_bytes(spec.memory_budget, "memory_budget")
        except ValueError as exc:
            raise ConfigError(f"tune spec: [fitness] {exc}") from None
    base = base_config(spec)
    for key in spec.space:
        _check_key(key, base)
    for corner in ("low", "high") if plan_corners else ():  # refused values stop the search
        params = {k: (v[0] if corner == "low" else v[-1]) for k, v in spec.space.items()}
        make_plan(trial_config(spec, params))


def _check_key(key: str, base: RunConfig) -> None:
    from memstudy.techniques import get_technique

    section, _, name = key.partition(".")
    if not name:
        raise ConfigError(f"tune space {key!r}: write <section or technique>.<name>, "
                          "e.g. train.lr or lowrank.beta")
    if section in SETTING_SECTIONS:
        valid = {f.name for f in dataclasses.fields(getattr(base, section))}
        if name not in valid:
            raise ConfigError(f"tune space {key!r}: [{section}] has no setting {name!r}; "
                              f"valid: {sorted(valid)}")
        return
    chosen = [t.split(":")[0] for t in base.techniques]
    if section not in chosen:
        raise ConfigError(f"tune space {key!r}: technique {section!r} is not in [base] "
                          f"techniques {base.techniques}; add it there or fix the name")
    options = {f.name for f in dataclasses.fields(get_technique(section).options)}
    if name not in options:
        raise ConfigError(f"tune space {key!r}: technique {section} has no option {name!r}; "
                          f"options: {sorted(options)}")


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


def search_limits(spec: TuneSpec) -> dict[str, tuple]:
    """The space as Propulate sees it: log ranges as (log10 low, log10 high)."""
    return {k: ((math.log10(v[0]), math.log10(v[1])) if isinstance(v, LogRange) else v)
            for k, v in spec.space.items()}


def trial_value(dim: tuple, searched: Any) -> Any:
    """A value Propulate proposed (in search_limits' terms) as the setting's value; a log
    range's value is clipped into [low, high] (10 ** log10(x) may land one ulp outside)."""
    if isinstance(dim, LogRange):
        return min(max(10.0 ** float(searched), dim[0]), dim[1])
    if all(isinstance(v, str) for v in dim):
        return str(searched)
    return int(round(searched)) if isinstance(dim[0], int) else float(searched)


def recorded_figures(db, digest: str) -> dict[str, Any] | None:
    """The latest recorded run of this config: status, last-epoch losses (rank 0), peak bytes,
    Tri-Accel's efficiency score."""
    from memstudy.techniques.tri_accel.score import run_efficiency

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
            "efficiency_score": run_efficiency(db, run_id)["score"] if status == "ok" else None,
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
    return METRICS[metric] * float(value)


class Trials:
    """Runs (or finds recorded) trials; the loss function Propulate calls."""

    def __init__(self, spec: TuneSpec, db, progress: Callable[[str], None] | None = None,
                 device: str | None = None):
        self.spec, self.db, self.progress, self.device = spec, db, progress, device
        self.budget = parse_bytes(spec.memory_budget, "memory_budget") if spec.memory_budget else None
        self.ran: list[str] = []  # hashes trained by this process
        self.reused: list[str] = []  # hashes found recorded
        self.refused: list[dict[str, Any]] = []  # trial settings refused before anything ran

    def __call__(self, searched: dict[str, Any]) -> float:
        """Propulate's loss function: `searched` holds the values in search_limits' terms."""
        params = {k: trial_value(self.spec.space[k], v) for k, v in dict(searched).items()
                  if k in self.spec.space}
        return self.evaluate(params)

    def evaluate(self, params: dict[str, Any]) -> float:
        from memstudy.runner import config_hash, execute

        cfg = trial_config(self.spec, params)
        if self.device is not None:
            cfg.train.device = self.device
        try:  # a combination of values refused (by a technique's check): nothing runs
            digest = config_hash(cfg)
            figures = recorded_figures(self.db, digest)
            if figures is None:
                execute(cfg, self.db, self.progress)
        except ConfigError as exc:
            self.refused.append(params)
            self._say(f"trial {params} refused before it ran: {exc} -> fitness inf")
            return math.inf
        if figures is None:
            self.ran.append(digest)
            figures = recorded_figures(self.db, digest)
        else:
            self.reused.append(digest)
        value = fitness(figures, self.spec.metric, self.budget)
        self._say(f"trial {params} -> run {figures['run_id']} {figures['status']} fitness "
                  f"{value:.4f}{' (recorded before)' if digest in self.reused else ''}")
        return value

    def _say(self, line: str) -> None:
        if self.progress:
            self.progress(line)
