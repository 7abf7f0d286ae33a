"""What one experiment is: the runs that a report row, a decision candidate or an advise fit
may average.

Two runs are one experiment when every resolved setting that changes what is measured is the
same: their stored configs (runs.config_json) agree on everything but the seed, the free-text
label and the settings below that measure nothing. The key is built from the whole stored
config, not from a list of settings, so a setting added to the config later (the network, the
task, ...) splits rows without this module naming it.

- The seed is what a study repeats: `memstudy run --seed` and a grid's `seeds` set both
  `train.seed` (the initial weights) and `data.seed` (which phantoms are drawn, or which folder
  images form the train / validation split), so both are averaged over. What the data *are*
  (`data.source`, `data.path`, the image counts, `data.resize`) is part of the key.
- `data.cache_dir` only says where generated items are kept; `train.device` is replaced by the
  device the run was on (its GPU's name, or 'cpu'), so `auto` and `cpu` on one CPU are one
  experiment and two GPU models are two.
- A setting an older memstudy did not record is read as its current default: a default
  added later keeps the behaviour from before it (the config hash makes the same assumption,
  config.HASH_NEUTRAL_DEFAULTS), so old and new runs of one experiment stay one row.

Rows that share a technique set, size, batch and device but not the rest are separate rows,
and `differs` names the settings in which they differ (`train.lr=0.01, data.train_images=6`).
Comparisons against original (ratios, time x original, quality cost) pair rows that agree on
every setting that splits some technique set's rows (`comparison`), so a set is never compared
with an original trained differently in a way that the report itself tells apart.
Torch-free, like the rest of memstudy.report.
"""
from __future__ import annotations

import json
from collections import defaultdict
from functools import lru_cache
from typing import Any, Callable, Hashable, Iterable

from memstudy.report.data import device_of

# the settings that measure nothing (see the module docstring); techniques are keyed apart,
# canonically (report.tables.technique_set)
NOT_MEASURED = frozenset({"label", "train.seed", "data.seed", "data.cache_dir", "train.device",
                          "techniques"})
Settings = dict[str, str]


@lru_cache(maxsize=1)
def _defaults() -> dict[str, Any]:
    from memstudy.config import RunConfig  # torch-free (tests/test_architecture.py)

    return RunConfig().to_dict()


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if nested else value
    return out


def _flatten(tree: dict[str, Any], prefix: str = "") -> Settings:
    out: Settings = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value, sort_keys=True)
    return out


def settings(run: dict[str, Any]) -> Settings:
    """The run's measured settings as dotted names -> JSON values (defaults filled in)."""
    flat = _flatten(_merge(_defaults(), run.get("config") or {}))
    return {k: v for k, v in flat.items() if k not in NOT_MEASURED}


def technique_set(run: dict[str, Any]) -> tuple[str, ...]:
    """The technique set a run was hashed with: its stored config's canonical techniques (the
    same set typed in another order or spelling is one set), else the name as typed."""
    config = run.get("config") or {}
    return tuple(config["techniques"]) if "techniques" in config else (run["name"],)


def experiment(run: dict[str, Any], across: Iterable[str] = ()) -> tuple:
    """The key of the run's experiment; `across` names settings to leave out of it (advise
    fits a line across image sizes)."""
    skip = set(across)
    rest = tuple(sorted((k, v) for k, v in settings(run).items() if k not in skip))
    return (technique_set(run), device_of(run), rest)


def varying(groups: Iterable[list[Settings]]) -> set[str]:
    """The settings whose values differ inside at least one of `groups` (each a list of the
    settings of experiments that a reader would otherwise take for one)."""
    keys: set[str] = set()
    for group in groups:
        for key in set().union(*group):
            if len({s.get(key) for s in group}) > 1:
                keys.add(key)
    return keys


def describe(values: Settings, keys: Iterable[str]) -> str:
    """'data.train_images=6, train.lr=0.01': the values of `keys`, as --set writes them."""
    return ", ".join(f"{k}={_plain(values.get(k, 'null'))}" for k in sorted(keys))


def _plain(value: str) -> str:
    decoded = json.loads(value)
    return decoded if isinstance(decoded, str) else value


def same_row(run: dict[str, Any]) -> tuple:
    """What a reader takes for one row: the same set, size, batch and device."""
    return technique_set(run), run["image_size"], run["batch_size"], device_of(run)


def split(groups: dict[Hashable, dict[str, Any]], cluster: Callable[[dict], Hashable] = same_row,
          across: Iterable[str] = ()) -> tuple[dict[Hashable, str], set[str]]:
    """For experiments {key: one of their runs}: (per key, what differs from the other
    experiments of its cluster; every setting that splits some cluster). The values of the
    latter (`comparison`) decide which rows may be compared with each other. `across`: the
    settings the experiments were keyed across (experiment's argument), never named."""
    skip = set(across)
    values = {key: {k: v for k, v in settings(run).items() if k not in skip}
              for key, run in groups.items()}
    clusters: dict[Hashable, list[Hashable]] = defaultdict(list)
    for key, run in groups.items():
        clusters[cluster(run)].append(key)
    shown: dict[Hashable, str] = {}
    for keys in clusters.values():
        apart = varying([[values[k] for k in keys]])
        shown.update({k: describe(values[k], apart) for k in keys})
    return shown, varying([values[k] for k in keys] for keys in clusters.values())


def comparison(run: dict[str, Any], keys: set[str]) -> str:
    """The run's values of `keys` (split's second result): rows compare when these agree."""
    return describe(settings(run), keys)


def label_experiments(groups: dict[Hashable, dict[str, Any]],
                      cluster: Callable[[dict], Hashable] = same_row, across: Iterable[str] = ()
                      ) -> tuple[dict[Hashable, str], dict[Hashable, str]]:
    """split's result with each experiment's `comparison` in place of the keys."""
    shown, keys = split(groups, cluster, across)
    return shown, {k: comparison(run, keys) for k, run in groups.items()}
