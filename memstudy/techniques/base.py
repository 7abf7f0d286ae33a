"""The technique protocol: a named, staged transformation of a built pipeline.

A technique is one module in this package that calls `register(Technique(...))`. It has
a small options dataclass, declared torch-free in options.py with the technique's stage and
order (the first field is the positional option, so `amp:bf16` sets `dtype`), a `check`
that refuses impossible combinations before anything is built, and an `apply` that acts on
the `Build` (model, runtime policies, optimizer factory).

It also declares what composition needs to know about it (`order` within its stage and facts
such as `shards_batch` or `owns_process_group`), each with a default that fits most
techniques: compose.py alone orders and applies techniques, and the rest of memstudy asks the
`Plan` for these facts instead of naming techniques.
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
    PROCESS = -1  # process-level settings applied before CUDA initialises (allocator)
    STRUCTURE = 0  # invertible residuals, low-rank, quantization, model-parallel split
    ACTIVATION = 1  # checkpointing, offload, activation compression
    COMPILE = 2  # torch.compile
    PARALLEL = 3  # DDP, ZeRO, FSDP wrappers, optimizer-state offload
    RUNTIME = 4  # autocast, loss scaling, adaptive precision, elastic batch, accumulation


@dataclass
class Plan:
    """What is known before anything is built; techniques validate combinations against it."""
    config: "RunConfig"
    device: "torch.device"
    n_gpus: int
    chosen: dict[str, Any]  # technique name -> its options, in the canonical composition order
    techniques: dict[str, "Technique"] = field(default_factory=dict)  # name -> its declaration
    budget_bytes: int | None = None  # config.budget in bytes, parsed once (check_early)

    def has(self, name: str) -> bool:
        return name in self.chosen

    def declaring(self, fact: str) -> list[str]:
        """Chosen techniques (in composition order) whose declared `fact` holds for their options."""
        return [n for n, opts in self.chosen.items() if self.techniques[n].holds(fact, opts)]

    def group_owners(self) -> list[str]:
        """Techniques that need the whole process group of world_size processes."""
        return self.declaring("owns_process_group")

    def shards_batch(self) -> bool:
        return bool(self.declaring("shards_batch"))

    def gpus_per_process(self) -> int:
        return max([self.techniques[n].value("gpus_per_process", o)
                    for n, o in self.chosen.items()], default=1)

    def gpus_needed(self) -> int:
        """GPUs a run of this plan holds at once: none on the CPU (gloo processes share the
        cores), else gpus_per_process for each of the world_size processes."""
        if self.device.type != "cuda":
            return 0
        return self.config.world_size * self.gpus_per_process()

    def applied(self) -> list[str]:
        """The techniques as applied: canonical order, every option spelled out (hashed)."""
        return [self.techniques[n].canonical(o) for n, o in self.chosen.items()]


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


Fact = bool | int | Callable[[Any], Any]  # a constant, or a function of the technique's options


@dataclass(frozen=True)
class Technique:
    name: str
    stage: Stage
    options: type  # a dataclass; field metadata {"choices": (...), "help": "..."}
    summary: str
    apply: Callable[[Any, Build], None]
    check: Callable[[Any, Plan], None] = _no_check
    # Process-level settings (PROCESS stage), applied by compose.prepare_process after the
    # plan is validated and before anything initialises CUDA in the run's process.
    prepare: Callable[[Any, Plan], None] | None = None
    # What composition needs to know. Techniques are applied in (stage, order, name) order,
    # whatever order the user listed them in; see memstudy.techniques.compose.
    order: int = 50  # position within the stage, lower first (0..100 by convention)
    shards_batch: Fact = False  # each rank draws batch_size / world_size of every global batch
    # (an incomplete last global batch is dropped)
    owns_process_group: Fact = False  # needs the whole group of world_size processes; at most
    # one such technique per run (2-D parallelism is not supported)
    gloo_on_cuda: bool = False  # (group owners) its collectives run over gloo with CUDA tensors
    gpus_per_process: Fact = 1  # GPUs each process of the run holds
    splits_model: Fact = False  # replaces the model by a part of it on each device, so it must
    # see the final modules (highest order of STRUCTURE) and nothing may chain the whole model
    splits_gradients: Fact = False  # each rank holds only part of the gradients (a per-rank
    # gradient norm is not the model's)
    sets_learning_rate: Fact = False  # a text saying how it sets the learning rate itself
    # (the training policy's schedule and scaling would fight it), or False
    compiles: Fact = False  # the first step compiles the model (its time is recorded apart)
    contiguous_weights: Fact = False  # needs contiguous parameters (FSDP2 shards only those):
    # train.channels_last then defaults to off, and on is refused (RunConfig.check)
    varies_batch: Fact = False  # changes the batch size during the run: each new size is a new
    # shape for cuDNN's autotuner, so train.cudnn_benchmark then defaults to off
    # (techniques.resolve_run_settings)
    micro_batches: Fact = 1  # micro-batches of train.batch_size per optimizer step at the
    # start (how long a run is: techniques.planned_steps)
    most_micro_batches: Fact = 1  # the most micro-batches per step it may take during the run
    needs_unet: Fact = False  # a text naming the U-Net structure it acts on ("tiles the
    # U-Net's top levels"), or False: a user's own network (model.factory) is then refused
    folded_upsampling_levels: Fact = 0  # top decoder levels that never call nearest
    # up-sampling (tile's folded up-convolution): compose.check_upsampling leaves them out
    resolve: Callable[[Any, Plan], Any] | None = None  # the options a run uses where the plan
    # decides them (tile:auto's pick); facts that depend on them are read through `actual`
    explain: Callable[[Any, Plan], str | None] | None = None  # a line on how the plan
    # resolves it, for `memstudy run --dry-run` (tile:auto's pick, stream's host memory)

    def explained(self, options: Any, plan: Plan) -> str | None:
        """What it says of how the plan resolves it (memstudy run --dry-run), or None."""
        return None if self.explain is None else self.explain(options, plan)

    def actual(self, options: Any, plan: Plan) -> Any:
        """The options as the run uses them: resolved against the plan, where they need it."""
        return options if self.resolve is None else self.resolve(options, plan)

    def value(self, fact: str, options: Any) -> Any:
        """A declared fact for these options."""
        declared = getattr(self, fact)
        return declared(options) if callable(declared) else declared

    def holds(self, fact: str, options: Any) -> bool:
        return bool(self.value(fact, options))

    def parse(self, args: list[str]) -> Any:
        """Options from ['bf16'] or ['placement=sqrt', 'segments=4']; errors name the option."""
        return parse_options(self.name, self.options, args)

    def canonical(self, options: Any) -> str:
        return canonical_options(self.name, options)


@dataclass(frozen=True)
class Declared:
    """What parsing a technique list needs, without torch (memstudy/techniques/options.py):
    the name, the options dataclass, and where it composes (stage, then order)."""
    name: str
    stage: Stage
    options: type
    order: int = 50

    def parse(self, args: list[str]) -> Any:
        return parse_options(self.name, self.options, args)

    def canonical(self, options: Any) -> str:
        return canonical_options(self.name, options)


def parse_options(name: str, options: type, args: list[str]) -> Any:
    """Options from ['bf16'] or ['placement=sqrt', 'segments=4']; errors name the option."""
    fields = dataclasses.fields(options)
    hints = typing.get_type_hints(options)
    values: dict[str, Any] = {}
    for i, arg in enumerate(args):
        key, sep, text = arg.partition("=")
        if not sep:
            if i > 0 or not fields:
                raise ConfigError(f"technique {name}: {arg!r} needs a name, e.g. "
                                  f"{name}:{fields[0].name if fields else 'option'}=...")
            key, text = fields[0].name, arg
        match = [f for f in fields if f.name == key]
        if not match:
            raise ConfigError(f"technique {name} has no option {key!r}; options: "
                              f"{[f.name for f in fields]}")
        values[key] = _convert(name, match[0], hints[key], text)
    return options(**values)


def canonical_options(name: str, options: Any) -> str:
    """Every option spelled out, except an option added after runs were recorded
    (metadata "hash_neutral") at the value those runs had (its default, or metadata
    "recorded_as" where the default changed since): those runs did what that value does, and
    their configs keep their hashes (grids and maxres probes resume)."""
    parts = [f"{f.name}={getattr(options, f.name)}" for f in dataclasses.fields(options)
             if not (f.metadata.get("hash_neutral")
                     and getattr(options, f.name) == f.metadata.get("recorded_as", f.default))]
    return ":".join([name, *parts])


def _convert(tech: str, f: dataclasses.Field, hint: Any, text: str) -> Any:
    choices = f.metadata.get("choices")
    if choices and text not in choices:
        raise ConfigError(f"technique {tech}: {f.name}={text!r} is not one of {list(choices)}")
    if text in f.metadata.get("words", ()):  # a word an option takes beside its numbers
        return text
    base = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    kind = base[0]
    if text.lower() == "none" and type(None) in typing.get_args(hint):  # "None": canonical form
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
