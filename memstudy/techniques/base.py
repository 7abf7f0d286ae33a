"""The technique protocol: a named, staged transformation of a built pipeline.

A technique is one module in this package that calls `register(Technique(...))`. It has
a small options dataclass (the first field is the positional option, so `amp:bf16`
sets `dtype`), a `check` that refuses impossible combinations before anything is built,
and an `apply` that acts on the `Build` (model, runtime policies, optimizer factory).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Callable

from memstudy.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from memstudy.config import RunConfig
    from memstudy.runtime import Runtime


class Stage(IntEnum):
    """Composition order; see memstudy.techniques.compose for why it is this one."""
    STRUCTURE = 0  # invertible residuals, low-rank, quantization, model-parallel split
    ACTIVATION = 1  # checkpointing, offload, activation compression
    COMPILE = 2  # torch.compile
    PARALLEL = 3  # DDP, ZeRO, FSDP wrappers
    RUNTIME = 4  # autocast, loss scaling, adaptive precision, elastic batch, accumulation


@dataclass
class Plan:
    """What is known before anything is built; techniques validate combinations against it."""
    config: "RunConfig"
    device: "torch.device"
    n_gpus: int
    chosen: dict[str, Any]  # technique name -> its options, in composition order

    def has(self, name: str) -> bool:
        return name in self.chosen


@dataclass
class Build:
    """The pipeline under construction; techniques mutate it in stage order."""
    config: "RunConfig"
    plan: Plan
    model: "nn.Module"
    runtime: "Runtime"
    device: "torch.device"
    placed: bool = False  # a structural technique placed the model on its device(s) itself
    notes: dict[str, Any] = field(default_factory=dict)  # technique facts worth recording


def _no_check(options: Any, plan: Plan) -> None:
    return None


@dataclass(frozen=True)
class Technique:
    name: str
    stage: Stage
    options: type  # a dataclass; field metadata {"choices": (...), "help": "..."}
    summary: str
    apply: Callable[[Any, Build], None]
    check: Callable[[Any, Plan], None] = _no_check

    def parse(self, args: list[str]) -> Any:
        """Options from ['bf16'] or ['placement=sqrt', 'segments=4']; errors name the option."""
        fields = dataclasses.fields(self.options)
        hints = typing.get_type_hints(self.options)
        values: dict[str, Any] = {}
        for i, arg in enumerate(args):
            key, sep, text = arg.partition("=")
            if not sep:
                if i > 0 or not fields:
                    raise ConfigError(f"technique {self.name}: {arg!r} needs a name, e.g. "
                                      f"{self.name}:{fields[0].name if fields else 'option'}=...")
                key, text = fields[0].name, arg
            match = [f for f in fields if f.name == key]
            if not match:
                raise ConfigError(f"technique {self.name} has no option {key!r}; options: "
                                  f"{[f.name for f in fields]}")
            values[key] = _convert(self.name, match[0], hints[key], text)
        return self.options(**values)

    def canonical(self, options: Any) -> str:
        parts = [f"{f.name}={getattr(options, f.name)}" for f in dataclasses.fields(options)]
        return ":".join([self.name, *parts])


def _convert(tech: str, f: dataclasses.Field, hint: Any, text: str) -> Any:
    choices = f.metadata.get("choices")
    if choices and text not in choices:
        raise ConfigError(f"technique {tech}: {f.name}={text!r} is not one of {list(choices)}")
    base = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    kind = base[0]
    if text == "none" and type(None) in typing.get_args(hint):
        return None
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise ValueError
            return text.lower() in ("true", "1", "on")
        return kind(text) if kind in (int, float, str) else text
    except ValueError:
        raise ConfigError(f"technique {tech}: {f.name}={text!r} is not a valid "
                          f"{getattr(kind, '__name__', kind)}") from None
