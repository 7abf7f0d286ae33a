"""lowrank: OIALR ([Coquelin] (docs/references.md) chapter 4, Algorithm 1): after d full-rank steps every eligible
weight is trained as U Sigma V^T with only the r x r Sigma trainable; every nu steps the bases
absorb Sigma's rotation (eq. 4.13) and singular values below beta * max are dropped.

Memory / compute trade-off. Saved: the optimizer state (Adam: two moments per trainable
element) and the gradients of the converted weights shrink from m * n to r * r each; once the
rank falls the parameters held shrink from m * n to (m + n + r) * r. Paid: one SVD per weight
at the conversion and per base update (float64, on the device), one m x r x n product per
weight in every forward (the weight is rebuilt before its module runs: one weight-sized
tensor per layer lives until backward, and its gradient is formed transiently before being
projected onto Sigma). At full rank right after the conversion U Sigma V^T holds *more* than
W (U and V^T besides Sigma): the saving comes only once beta has cut the ranks.

The controller is a step hook (memstudy.lowrank.oialr); figures per control step go to the
run's `series`. docs/techniques/lowrank.md gives the options, the records and what cannot be
combined.
"""
from __future__ import annotations

from memstudy.errors import ConfigError
from memstudy.techniques import planned_steps, register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import LowrankOptions as Options

# Techniques verified to act correctly on a model whose parameters change during the run.
# Wrappers that capture the parameter set at build time (DDP, FSDP, ZeRO, torch.compile) or
# own the optimizer / module structure (tri_accel, quantization, invertible, mp, pipeline)
# would silently train the wrong parameters, so they are refused by name.
COMPOSES_WITH = ("amp", "checkpoint", "offload")


def resolved_d(opts: Options, plan_or_config) -> int:
    config = getattr(plan_or_config, "config", plan_or_config)
    steps = planned_steps(config, config.data.train_images)
    return steps // 3 if opts.d is None else opts.d


def check(opts: Options, plan: Plan) -> None:
    if not 0 < opts.beta < 1:
        raise ConfigError(f"lowrank:beta must be in (0, 1) (got {opts.beta}): it is the fraction "
                          "of the largest singular value below which ranks are dropped")
    if not 0 < opts.alpha <= 1:
        raise ConfigError(f"lowrank:alpha must be in (0, 1] (got {opts.alpha})")
    if opts.nu < 1:
        raise ConfigError(f"lowrank:nu must be >= 1 step (got {opts.nu})")
    steps = planned_steps(plan.config, plan.config.data.train_images, chosen=plan.chosen)
    d = resolved_d(opts, plan)
    if d < 0 or d >= steps:
        raise ConfigError(f"lowrank:d={d} must be in [0, {steps - 1}]: this run takes {steps} "
                          f"optimizer step(s), so d={d} leaves no low-rank step; lower lowrank:d "
                          "or raise train.epochs / data.train_images")
    for name in plan.chosen:
        if name != "lowrank" and name not in COMPOSES_WITH:
            raise ConfigError(f"lowrank replaces weights by trainable factors during the run; "
                              f"{name} is not known to follow that change (lowrank composes with "
                              f"{', '.join(COMPOSES_WITH)}): drop {name} or lowrank")


def apply(opts: Options, build: Build) -> None:
    from memstudy.lowrank.oialr import OIALRController

    d = resolved_d(opts, build.config)
    controller = OIALRController(build.model, d, opts.nu, opts.alpha, opts.beta,
                                 opts.skip_first, opts.skip_last, rank=build.runtime.rank)
    build.runtime.step_hooks.append(controller.on_step)
    build.runtime.series_sources.append(controller.series)
    build.notes["lowrank"] = {"d": d, "layers": [n for n, _ in controller.layers]}
    build.notes["lowrank_controller"] = controller


register(Technique("lowrank", Stage.STRUCTURE, Options,
                   "OIALR: after d full-rank steps train only Sigma of U Sigma V^T, ranks cut "
                   "every nu steps", apply, check))
