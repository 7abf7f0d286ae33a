"""The registry's machinery: the table of registered techniques and the loading of the
technique modules (every module of memstudy.techniques not starting with an underscore, once,
on the first question), so that adding a technique is adding one file.
"""
from __future__ import annotations

import importlib
import pkgutil

from memstudy.errors import ConfigError
from memstudy.techniques.base import Technique

PACKAGE = "memstudy.techniques"
_REGISTRY: dict[str, Technique] = {}
_LOADED = False
_INTERNAL = {"base", "compose"}


def register(technique: Technique) -> Technique:
    if technique.name in _REGISTRY:
        raise RuntimeError(f"technique {technique.name!r} registered twice")
    _REGISTRY[technique.name] = technique
    return technique


def _load() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for mod in pkgutil.iter_modules(importlib.import_module(PACKAGE).__path__):
            if not mod.name.startswith("_") and mod.name not in _INTERNAL:
                importlib.import_module(f"{PACKAGE}.{mod.name}")


def technique_names() -> list[str]:
    """The technique modules' names, sorted, from the file names alone (nothing imported)."""
    return sorted(mod.name for mod in pkgutil.iter_modules(importlib.import_module(PACKAGE).__path__)
                  if not mod.name.startswith("_") and mod.name not in _INTERNAL)


def composition_key(technique: Technique) -> tuple[int, int, str]:
    """The one composition order: stage, then declared order within the stage, then name."""
    return (int(technique.stage), technique.order, technique.name)


def list_techniques() -> list[Technique]:
    _load()
    return sorted(_REGISTRY.values(), key=composition_key)


def get_technique(name: str) -> Technique:
    _load()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown technique {name!r}; valid: {sorted(_REGISTRY)} "
                          "(see `memstudy techniques`)")
    return _REGISTRY[name]
