"""The registry's machinery: the table of registered techniques and the loading of the
technique modules (every module of memstudy.techniques not starting with an underscore, once,
on the first question), so that adding a technique is adding one file, and its options to
options.py (the declarations parsing needs, without torch: `declared`).
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from memstudy.errors import ConfigError
from memstudy.techniques.base import Declared, Technique
from memstudy.techniques.options import DECLARED

PACKAGE = "memstudy.techniques"
_REGISTRY: dict[str, Technique] = {}
_LOADED = False
_INTERNAL = {"base", "compose", "options"}


def register(technique: Technique) -> Technique:
    if technique.name in _REGISTRY:
        raise RuntimeError(f"technique {technique.name!r} registered twice")
    _check_declared(technique)
    _REGISTRY[technique.name] = technique
    return technique


def _check_declared(technique: Technique) -> None:
    """A technique registers the options, stage and order options.py declares for it (what
    parse_techniques parsed and ordered by before any technique module was imported)."""
    name = technique.name
    if name not in DECLARED:
        raise RuntimeError(f"technique {name!r} has no declaration in "
                           "memstudy/techniques/options.py; add its options there")
    want = DECLARED[name]
    if (technique.stage, technique.order) != (want.stage, want.order):
        raise RuntimeError(f"technique {name!r} registers stage {technique.stage.name} order "
                           f"{technique.order}, but options.py declares {want.stage.name} order "
                           f"{want.order}; make them agree")
    if technique.options is not want.options and _fields(technique.options) != _fields(want.options):
        raise RuntimeError(f"technique {name!r} registers other options than options.py "
                           f"declares ({want.options.__name__}); register that class")


def _fields(options: type) -> list[tuple]:
    return [(f.name, f.default, str(f.type), dict(f.metadata)) for f in dataclasses.fields(options)]


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


def composition_key(technique: Technique | Declared) -> tuple[int, int, str]:
    """The one composition order: stage, then declared order within the stage, then name."""
    return (int(technique.stage), technique.order, technique.name)


def list_techniques() -> list[Technique]:
    _load()
    return sorted(_REGISTRY.values(), key=composition_key)


def declared(name: str) -> Declared:
    """A technique's declaration (options, stage, order), without importing its module."""
    if name not in DECLARED:
        raise ConfigError(f"unknown technique {name!r}; valid: {sorted(DECLARED)} "
                          "(see `memstudy techniques`)")
    return DECLARED[name]


def get_technique(name: str) -> Technique:
    _load()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown technique {name!r}; valid: {sorted(_REGISTRY)} "
                          "(see `memstudy techniques`)")
    return _REGISTRY[name]
