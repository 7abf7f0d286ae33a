"""Records of an older memstudy: which cells a grid reruns because their config hashes differ now.

A cell is resumed only by its exact config hash. A run recorded by an older memstudy whose
config, read by today's code (new settings at their defaults, techniques in today's canonical
spelling), hashes to a cell's hash measured that cell under settings that did not yet exist
(e.g. a loss that was computed differently before its setting was added); it is not taken as
the cell's run, and the grid says so, naming the run and the settings that differ.
"""
from __future__ import annotations

import json
from typing import Any, Protocol

from memstudy.config import from_dict
from memstudy.errors import ConfigError
from memstudy.runner import config_hash, resolved
from memstudy.store import ResultsDB


class Cell(Protocol):
    """What this module reads of a grid's cell (memstudy/grid/spec.py, which imports this
    module: so the cell is described here, not imported)."""
    index: int
    hash: str | None
    error: str | None


def older_records(cells: list[Cell], db: ResultsDB) -> dict[int, str]:
    """{cell index: why it reruns} for the cells to run that an older record resembles."""
    wanted = {c.hash: c for c in cells if c.hash and not c.error}
    reasons: dict[int, str] = {}
    for row in db.query("SELECT id, config_hash, config_json FROM runs ORDER BY id"):
        if row["config_hash"] in wanted:
            continue
        stored = json.loads(row["config_json"])
        try:
            today = from_dict(json.loads(row["config_json"]))
            key = config_hash(today)
        except (ConfigError, ValueError, TypeError, KeyError):
            continue  # a config today's memstudy cannot read is no cell of today's grids
        cell = wanted.get(key)
        if cell is None or cell.index in reasons:
            continue
        changed = differing(stored, resolved(today).to_dict())
        reasons[cell.index] = (f"reruns: run #{row['id']} recorded this cell under hash "
                               f"{row['config_hash']} (an older memstudy; differing now: "
                               f"{', '.join(changed) or 'the hash form'}); its hash is {key}")
    return reasons


def differing(stored: dict[str, Any], today: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between a stored config and today's reading of it."""
    keys = []
    for key in sorted(set(stored) | set(today)):
        if key == "label":
            continue
        a, b = stored.get(key, "<absent>"), today.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            keys += differing(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key}" + (" (absent then)" if a == "<absent>" else ""))
    return keys
