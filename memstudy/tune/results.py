"""A search's recorded trials ranked by fitness (`memstudy tune spec.toml --best N`): what turns
the best trial into new defaults is read from the database, never guessed.

A run belongs to a spec's search when its label is `tune` and its stored config is the spec's
trial config for the settings read back from that stored config (same resolved hash; the device
is taken from the run, as each worker sets its own). Needs neither Propulate nor MPI.
"""
from __future__ import annotations

import json
from typing import Any

from memstudy.byte_sizes import parse_bytes
from memstudy.tune import (SETTING_SECTIONS, TUNE_LABEL, TuneSpec, fitness, recorded_figures,
                           trial_config)


def stored_params(spec: TuneSpec, config: dict[str, Any]) -> dict[str, Any] | None:
    """The searched settings as a stored run config holds them (None: a key is absent)."""
    params = {}
    for key, dim in spec.space.items():
        section, _, name = key.partition(".")
        if section in SETTING_SECTIONS:
            params[key] = config[section][name]
            continue
        text = _technique_option(config["techniques"], section, name)
        if text is None:
            return None
        params[key] = text if all(isinstance(v, str) for v in dim) else _number(dim, text)
    return params


def _technique_option(techniques: list[str], technique: str, option: str) -> str | None:
    for tech in techniques:
        name, *args = tech.split(":")
        if name == technique:
            values = dict(a.partition("=")[::2] for a in args)
            return values.get(option)
    return None


def _number(dim: tuple, text: str) -> int | float:
    return int(text) if isinstance(dim[0], int) else float(text)


def best_trials(spec: TuneSpec, db) -> list[dict[str, Any]]:
    """This spec's recorded trials, best first: run_id, status, fitness, the figures and the
    settings; trials of other specs in the same database are left out."""
    budget = parse_bytes(spec.memory_budget, "memory_budget") if spec.memory_budget else None
    rows = []
    for run in db.query("SELECT id, config_hash, config_json FROM runs WHERE label = ? "
                        "ORDER BY id", (TUNE_LABEL,)):
        config = json.loads(run["config_json"])
        params = stored_params(spec, config)
        if params is None or not _belongs(spec, params, config, run["config_hash"]):
            continue
        figures = recorded_figures(db, run["config_hash"])
        if figures["run_id"] != run["id"]:  # a config recorded twice: its latest run counts
            continue
        rows.append({**figures, "fitness": fitness(figures, spec.metric, budget),
                     "params": params, "techniques": config["techniques"]})
    return sorted(rows, key=lambda r: (r["fitness"], r["run_id"]))


def _belongs(spec: TuneSpec, params: dict[str, Any], config: dict[str, Any], digest: str) -> bool:
    from memstudy.runner import config_hash  # torch: only when trials are read back

    cfg = trial_config(spec, params)
    cfg.train.device = config["train"]["device"]
    return config_hash(cfg) == digest


def best_table(spec: TuneSpec, db, count: int) -> str:
    """Markdown: the `count` best trials, then the best trial's settings as a line to copy."""
    rows = best_trials(spec, db)
    if not rows:
        return "no recorded trial of this spec in the database"
    keys = list(spec.space)
    lines = [f"{len(rows)} recorded trial(s) of this spec; fitness = {_fitness_words(spec)}, "
             "minimised (docs/tune.md)", "",
             "| rank | run | status | fitness | " + " | ".join(keys) + " |",
             "|---" * (4 + len(keys)) + "|"]
    for i, r in enumerate(rows[:count], 1):
        values = " | ".join(f"{r['params'][k]:.4g}" if isinstance(r["params"][k], float)
                            else str(r["params"][k]) for k in keys)
        lines.append(f"| {i} | {r['run_id']} | {r['status']} | {r['fitness']:.6g} | {values} |")
    best = rows[0]
    settings = ", ".join(f"{k} = {best['params'][k]!r}" for k in keys)
    lines += ["", f"best: run {best['run_id']} (fitness {best['fitness']:.6g}): {settings}"]
    return "\n".join(lines)


def _fitness_words(spec: TuneSpec) -> str:
    value = ("-efficiency_score" if spec.metric == "efficiency_score"
             else f"last-epoch {spec.metric}")
    if spec.memory_budget:
        return f"{value} within {spec.memory_budget}, else 1 + peak / budget; failed runs inf"
    return f"{value}; failed runs inf"
