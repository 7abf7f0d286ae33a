"""Learning-rate schedules: the run-wide warmup + cosine of [Compute-Opt] (docs/references.md) (eq. 10, used by
`train.lr_schedule` through memstudy/policy.py), and the schedulers of split models, stepped
after every optimizer step.

The study could not use a scheduler under model parallelism (its cross-node setup kept no
ordinary optimizer per node). Here every rank owns a plain optimizer over its half, so a
scheduler per rank, stepped in lockstep by the same step hook, gives both halves the
same learning rate at every step.
"""
from __future__ import annotations

import math

import torch

from memstudy.errors import ConfigError
from memstudy.runtime import StepInfo

SCHEDULERS = ("none", "cosine", "step")
STEP_GAMMA = 0.5  # `step`: halve the learning rate once per epoch


def warmup_cosine(t: int, warmup: int, total: int, min_ratio: float) -> float:
    """Eq. 10 of [Compute-Opt] as a factor of eta_base for optimizer step t (1-based: the first
    step is t = 1, so warm-up never takes a step at lr 0):
    t / warmup for t <= warmup, else min_ratio + (1 - min_ratio) * 0.5 * (1 + cos(pi * (t -
    warmup) / (total - warmup))), which ends at eta_min = min_ratio * eta_base at t = total."""
    if t <= warmup:
        return t / warmup
    progress = min(1.0, (t - warmup) / (total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def steps_per_epoch(config) -> int:
    images = getattr(config.data, "train_images", None)
    if config.data.source != "synthetic" or images is None:
        raise ConfigError("a learning-rate scheduler needs the number of steps: set "
                          "train.max_steps (folder datasets have no count before loading)")
    return max(1, math.ceil(images / config.train.batch_size))


def total_steps(config) -> int:
    per_epoch = steps_per_epoch(config) if config.train.max_steps is None else None
    return config.train.max_steps or per_epoch * config.train.epochs


def make_scheduler(kind: str, optimizer: torch.optim.Optimizer, config):
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps(config))
    if kind == "step":
        per_epoch = (steps_per_epoch(config) if config.train.max_steps is None
                     else max(1, config.train.max_steps // config.train.epochs))
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=per_epoch, gamma=STEP_GAMMA)
    raise ConfigError(f"scheduler {kind!r} unknown; choose one of {SCHEDULERS}")


class SchedulerHook:
    """Step hook: creates the scheduler on the first step's optimizer, then steps it."""

    def __init__(self, kind: str, config, rank: int):
        self.kind, self.config, self.rank = kind, config, rank
        self.scheduler = None
        self.lrs: list[tuple[int, float]] = []  # (step, lr the next step uses)

    def __call__(self, info: StepInfo) -> None:
        if self.scheduler is None:
            self.scheduler = make_scheduler(self.kind, info.optimizer, self.config)
        self.scheduler.step()
        self.lrs.append((info.step, info.optimizer.param_groups[0]["lr"]))

    def series(self) -> list[tuple[int, int, str, float]]:
        return [(self.rank, step, "lr", lr) for step, lr in self.lrs]


def add_scheduler(kind: str, build) -> SchedulerHook | None:
    if kind == "none":
        return None
    hook = SchedulerHook(kind, build.config, build.runtime.rank)
    build.runtime.step_hooks.append(hook)
    build.runtime.series_sources.append(hook.series)  # stored as the `lr` series
    build.notes["scheduler"] = kind
    return hook
