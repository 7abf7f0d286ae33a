"""Training policy of [Compute-Opt] (docs/references.md) section III.C, set in [train] and recorded in the resolved config.

- `lr_schedule = "warmup_cosine"` (eq. 10): step t (1-based) trains at eta_base * t / t_warmup
  while t <= t_warmup (`lr_warmup_steps`), then cosine from eta_base down to eta_min =
  `lr_min_ratio` * eta_base at the run's last planned step T (techniques.planned_steps: epochs x
  steps per epoch at the initial k, capped by max_steps). `constant` keeps eta_base.
- `lr_scaling = "linear"` (eq. 11): eta_base = train.lr * B_eff / B_base, B_eff the images of
  the coming optimizer step over all ranks (batch_size x k micro-batches; adaptive k changes
  it step by step), B_base = `lr_base_batch` (unset: train.batch_size, so that `lr` stays the
  learning rate of one micro-batch and only accumulation / adaptive k scale it).
- `clip_norm = tau` (eq. 12): before each optimizer step the gradients (unscaled first under
  amp:fp16) are multiplied by min(1, tau / ||g||), ||g|| the L2 norm over all parameters
  (torch.nn.utils.clip_grad_norm_).
Recorded per step in `series`: `lr` (the rate step t trained at, when a schedule or scaling is
on) and `grad_norm` (||g|| before clipping, when clipping is on).
"""
from __future__ import annotations

import torch

from memstudy.lr_schedule import warmup_cosine
from memstudy.errors import ConfigError
from memstudy.runtime import Runtime, StepInfo
from memstudy.techniques import planned_steps

SCHEDULES = ("constant", "warmup_cosine")
SCALINGS = ("none", "linear")
DEFAULT_MIN_RATIO = 0.1  # the paper's "typically 0.1 * eta_base"


def check_settings(t) -> None:
    """Field checks of the policy settings of a TrainConfig (called by TrainConfig.check)."""
    if t.lr_schedule not in SCHEDULES:
        raise ConfigError(f"train.lr_schedule {t.lr_schedule!r} unknown; choose one of {SCHEDULES}")
    if t.lr_scaling not in SCALINGS:
        raise ConfigError(f"train.lr_scaling {t.lr_scaling!r} unknown; choose one of {SCALINGS}")
    if t.lr_warmup_steps < 0:
        raise ConfigError(f"train.lr_warmup_steps must be >= 0 (got {t.lr_warmup_steps})")
    if t.lr_schedule == "constant" and (t.lr_warmup_steps or t.lr_min_ratio != DEFAULT_MIN_RATIO):
        raise ConfigError("train.lr_warmup_steps and train.lr_min_ratio apply only to "
                          "train.lr_schedule = 'warmup_cosine'; set it or drop them")
    if not 0 <= t.lr_min_ratio <= 1:
        raise ConfigError(f"train.lr_min_ratio must be in [0, 1] (got {t.lr_min_ratio})")
    if t.lr_base_batch is not None:
        if t.lr_base_batch < 1:
            raise ConfigError(f"train.lr_base_batch must be >= 1 (got {t.lr_base_batch})")
        if t.lr_scaling == "none":
            raise ConfigError("train.lr_base_batch applies only to train.lr_scaling = 'linear'; "
                              "set it or drop lr_base_batch")
    if t.clip_norm is not None and not t.clip_norm > 0:
        raise ConfigError(f"train.clip_norm must be > 0 or unset (got {t.clip_norm})")
    if t.target_val_loss is not None:
        if not t.target_val_loss > 0:
            raise ConfigError(f"train.target_val_loss must be > 0 (got {t.target_val_loss})")
        if not t.validate:
            raise ConfigError("train.target_val_loss needs validation: set train.validate = true "
                              "or drop target_val_loss")


def check_plan(plan) -> None:
    """Combinations refused before anything is built (called by make_plan)."""
    t = plan.config.train
    scheduled = t.lr_schedule != "constant" or t.lr_scaling != "none"
    for name in plan.declaring("sets_learning_rate") if scheduled else []:
        how = plan.techniques[name].value("sets_learning_rate", plan.chosen[name])
        raise ConfigError(f"{name} {how}; train.lr_schedule / lr_scaling would set it too: use "
                          f"train.lr_schedule = 'constant' and train.lr_scaling = 'none' with "
                          f"{name}, or change {name}'s options")
    split = plan.declaring("splits_gradients")  # declared by the technique (base.Technique)
    if t.clip_norm is not None and split:
        raise ConfigError(f"train.clip_norm with {split[0]}: each rank holds only part of the "
                          "gradients, so a per-rank norm is not eq. 12's; drop clip_norm")
    if t.lr_schedule == "warmup_cosine":
        total = total_steps(plan.config, plan.chosen)
        if t.lr_warmup_steps >= total:
            raise ConfigError(f"train.lr_warmup_steps = {t.lr_warmup_steps} covers all {total} "
                              "planned optimizer steps, leaving no cosine decay; lower it")


def total_steps(config, chosen: dict | None = None) -> int:
    """T of eq. 10: the planned optimizer steps (needs a known image count or max_steps).
    `chosen`: config.techniques parsed, where the caller has them (the plan's)."""
    images = config.data.train_images if config.data.source == "synthetic" else None
    if images is None:
        if config.train.max_steps is None:
            raise ConfigError("train.lr_schedule = 'warmup_cosine' needs the number of steps: "
                              "set train.max_steps (folder datasets have no count before loading)")
        return config.train.max_steps
    return planned_steps(config, images, chosen=chosen)


def scaled_lr(lr: float, effective_batch: int, base_batch: int, rule: str) -> float:
    """Eq. 11: eta_base * B_eff / B_base under the linear rule; eta_base under `none`."""
    return lr * effective_batch / base_batch if rule == "linear" else lr


def effective_batch(rt: Runtime) -> int:
    """Images of the coming optimizer step over all ranks: batch_size x ranks x k."""
    return rt.batch_size * rt.shard[1] * rt.micro_batches


class LearningRatePolicy:
    """Sets every parameter group's lr before each optimizer step: eq. 10 times eq. 11."""

    def __init__(self, build, total: int | None):
        t = build.config.train
        self.t, self.rt, self.total = t, build.runtime, total
        self.base_batch = t.lr_base_batch or t.batch_size
        self.optimizer: torch.optim.Optimizer | None = None
        self.rows: list[tuple[int, float]] = []  # (step, lr it trained at)
        inner = self.rt.optimizer_factory

        def factory(model: torch.nn.Module) -> torch.optim.Optimizer:
            self.optimizer = inner(model)
            for group in self.optimizer.param_groups:  # per-group base rates, kept apart
                group["policy_base_lr"] = group["lr"]
            self.set_lr(1)
            return self.optimizer

        self.rt.optimizer_factory = factory
        self.rt.step_hooks.append(self.on_step)
        self.rt.series_sources.append(self.series)

    def factor(self, step: int) -> float:
        schedule = (warmup_cosine(step, self.t.lr_warmup_steps, self.total, self.t.lr_min_ratio)
                    if self.t.lr_schedule == "warmup_cosine" else 1.0)
        return schedule * scaled_lr(1.0, effective_batch(self.rt), self.base_batch, self.t.lr_scaling)

    def set_lr(self, step: int) -> None:
        factor = self.factor(step)
        for group in self.optimizer.param_groups:
            group["lr"] = group["policy_base_lr"] * factor
        self.rows.append((step, self.optimizer.param_groups[0]["lr"]))

    def on_step(self, info: StepInfo) -> None:
        # runs after the other step hooks that decide the next step (adaptive k): they were
        # installed with the techniques, this one after them
        self.set_lr(info.step + 1)

    def series(self) -> list[tuple[int, int, str, float]]:
        done = {s for s, _ in self.rows[:-1]}  # the last row is for a step never taken
        return [(self.rt.rank, step, "lr", lr) for step, lr in self.rows if step in done]


class GradientClipping:
    """Eq. 12 before each optimizer step; records ||g|| (before clipping) per step."""

    def __init__(self, build):
        self.tau, self.rt = build.config.train.clip_norm, build.runtime
        self.norms: list[tuple[int, torch.Tensor]] = []
        self._last: torch.Tensor | None = None
        self.rt.pre_step_hooks.append(self.clip)
        self.rt.step_hooks.append(self.on_step)
        self.rt.series_sources.append(self.series)

    def clip(self, optimizer: torch.optim.Optimizer) -> None:
        if self.rt.scaler is not None and self.rt.scaler.is_enabled():
            self.rt.scaler.unscale_(optimizer)  # clip the true gradients; step() won't unscale again
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self._last = torch.nn.utils.clip_grad_norm_(params, self.tau).detach()

    def on_step(self, info: StepInfo) -> None:
        if self._last is not None:  # read later: no host sync per step
            self.norms.append((info.step, self._last))
            self._last = None

    def series(self) -> list[tuple[int, int, str, float]]:
        return [(self.rt.rank, step, "grad_norm", float(n)) for step, n in self.norms]


def install(build) -> None:
    """Add the configured policies to a built pipeline (after every technique)."""
    t = build.config.train
    if t.lr_schedule != "constant" or t.lr_scaling != "none":
        total = (total_steps(build.config, build.plan.chosen)
                 if t.lr_schedule == "warmup_cosine" else None)
        LearningRatePolicy(build, total)
        build.notes["lr_policy"] = {"schedule": t.lr_schedule, "scaling": t.lr_scaling,
                                    "total_steps": total}
    if t.clip_norm is not None:
        GradientClipping(build)
