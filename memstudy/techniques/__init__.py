"""Registry of memory techniques: `list_techniques()`, `get_technique(name)`, `parse_techniques()`.

Every module in this package that does not start with an underscore is imported once and
registers its technique(s), so adding a technique is adding one file. The machinery (the
table, loading the modules) is private: `_registry.py`; this module answers questions about
technique lists (declared facts, canonical form, run length).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memstudy import step_count
from memstudy.config import budget_size
from memstudy.errors import ConfigError
from memstudy.techniques._registry import (composition_key, declared, get_technique,
                                           list_techniques, register, technique_names)
from memstudy.techniques.base import Build, Declared, Plan, Stage, Technique


def parse_techniques(specs: list[str]) -> dict[str, Any]:
    """['amp:bf16', 'checkpoint'] -> {name: options} in composition order (`composition_key`),
    whatever order `specs` lists them in. Torch-free: the declarations of options.py, no
    technique module, so a wrong name or option is refused before torch loads."""
    chosen: dict[str, tuple[Declared, Any]] = {}
    for spec in specs:
        name, *args = [p.strip() for p in spec.split(":")]
        tech = declared(name)
        if name in chosen:
            raise ConfigError(f"technique {name!r} given twice in techniques {specs}; keep one")
        chosen[name] = (tech, tech.parse(args))
    ordered = sorted(chosen.values(), key=lambda pair: composition_key(pair[0]))
    return {tech.name: opts for tech, opts in ordered}


def declaring(specs: list[str], fact: str) -> list[str]:
    """Techniques of `specs` (in composition order) whose declared `fact` holds for their
    options: what the harness asks instead of naming techniques (Plan.declaring once planned;
    `declared_by` where the techniques are parsed already)."""
    return declared_by(parse_techniques(specs), fact)


def declared_by(chosen: dict[str, Any], fact: str) -> list[str]:
    """`declaring` for parsed techniques (parse_techniques): nothing parsed again."""
    return [n for n, o in chosen.items() if get_technique(n).holds(fact, o)]


def shards_batch(specs: list[str]) -> bool:
    """Whether a technique of `specs` splits each global batch over the ranks."""
    return bool(declaring(specs, "shards_batch"))


@dataclass(frozen=True)
class Checked:
    """What check_early parsed from a config, handed down (make_plan, runner.execute) so
    that nothing parses it again. The config keeps what was written: it is stored and hashed."""
    chosen: dict[str, Any]  # technique name -> options, in composition order (parse_techniques)
    budget_bytes: int | None  # config.budget in bytes (byte_sizes.size_text writes it back)


def check_early(config) -> Checked:
    """What can be refused before torch and the technique modules load: the config's own
    checks (types, ranges, sizes, data source, files), its budget, then the technique list,
    parsed with its options (names, option names and values: options.py). Each is parsed
    here, once: the result is handed down. make_plan refuses the rest (combinations, the
    device)."""
    config.check()
    budget = None if config.budget is None else budget_size(config.budget)
    return Checked(parse_techniques(config.techniques), budget)


def micro_batches(specs: list[str], most: bool = False,
                  chosen: dict[str, Any] | None = None) -> int:
    """Micro-batches per optimizer step the techniques of `specs` declare: at the start, or
    with `most` the most they may take during the run (1 without accumulation). `chosen`:
    `specs` parsed, where the caller has them."""
    chosen = parse_techniques(specs) if chosen is None else chosen
    fact = "most_micro_batches" if most else "micro_batches"
    return max([get_technique(n).value(fact, o) for n, o in chosen.items()], default=1)


def planned_steps(config, train_images: int, most_micro_batches: bool = False,
                  chosen: dict[str, Any] | None = None) -> int:
    """Optimizer steps the run will take (at its initial batch size; an elastic batch takes
    fewer), from the run's settings and its techniques' declared facts (memstudy.step_count).
    With `most_micro_batches`: the fewest steps it can take (adaptive accumulation at its
    largest k). `chosen`: config.techniques parsed, where the caller has them (a plan's)."""
    chosen = parse_techniques(config.techniques) if chosen is None else chosen
    return step_count.planned_steps(
        config.train, train_images, shards_batch=bool(declared_by(chosen, "shards_batch")),
        micro_batches=micro_batches(config.techniques, most_micro_batches, chosen))


def resolve_run_settings(config, chosen: dict[str, Any]) -> None:
    """Run settings whose default a technique of `chosen` (config.techniques parsed) changes,
    only where unset (the resolved config stores the value used; runner.resolved applies them
    too, so a config hashed before its check hashes as the run it becomes): channels_last off
    where parameters must be contiguous (on is refused there), cudnn_benchmark off where the
    batch size changes during the run."""
    if not chosen:
        return
    needs = declared_by(chosen, "contiguous_weights")
    if needs and config.train.channels_last:
        raise ConfigError(f"{needs[0]} needs contiguous parameters (FSDP2 shards no other), "
                          "but train.channels_last = true stores convolution weights in NHWC; "
                          "set train.channels_last = false or leave it unset")
    if needs and config.train.channels_last is None:
        config.train.channels_last = False
    # cuDNN would time its algorithms again for every new batch size, inside timed epochs
    # (tri_accel's elastic batch on an H100: 4 steps in 17.6 s, amp:fp16 24 in 1.9 s)
    if config.train.cudnn_benchmark is None and declared_by(chosen, "varies_batch"):
        config.train.cudnn_benchmark = False


def canonical(specs: list[str]) -> list[str]:
    """Techniques with every option spelled out, in composition order (what gets hashed)."""
    return applied(parse_techniques(specs))


def applied(chosen: dict[str, Any]) -> list[str]:
    """Parsed techniques (parse_techniques) in canonical form: canonical() without parsing."""
    return [declared(n).canonical(o) for n, o in chosen.items()]


__all__ = ["Build", "Plan", "Stage", "Technique", "register", "list_techniques",
           "get_technique", "parse_techniques", "canonical", "composition_key", "declaring",
           "shards_batch", "micro_batches", "planned_steps", "resolve_run_settings",
           "check_early", "Checked", "applied", "declared", "declared_by", "technique_names"]
