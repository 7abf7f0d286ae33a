"""Tri-Accel ([Tri-Accel] (docs/references.md) section 3): per-unit adaptive precision, curvature-scaled learning rates
and a memory-elastic batch size, in one control loop every t_ctrl steps.

Trade-off. Precision: units whose gradient variance is low run in FP16/BF16 (half the
activation bytes they save for backward, faster matmuls), high-variance or high-curvature units
in FP32 (full memory, stable). Curvature: every t_curv steps, a double-backward pass on b_curv
images (optionally a crop) costs power_iters * top_k Hessian-vector products per unit and about
twice a step's activation memory on a small batch; it buys per-unit learning rates
eta_l = eta_0 / (1 + alpha * max(0, lambda_max)). Elastic batch: uses memory left free by
growing the batch (fewer, larger steps per epoch) and shrinks it near the budget or after an
out-of-memory error, which is caught and the step retried. Statistics cost one fused Triton
kernel per step on a GPU, reading the gradients in place from one flat buffer they live in
(`grad_layout=flat`: the gradients stay allocated between steps); the curvature estimates are
skipped when they would take more than `curv_budget` of the training time. Each part can be
switched off alone: `tri_accel:curvature=off`.
docs/triaccel.md gives every option and what is recorded.
"""
from __future__ import annotations

from memstudy.errors import ConfigError
from memstudy.quality import min_side
from memstudy.techniques import get_technique, register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import TriAccelOptions as Options

def check(opts: Options, plan: Plan) -> None:
    if not (opts.precision or opts.curvature or opts.elastic):
        raise ConfigError("tri_accel with precision, curvature and elastic all off does nothing; "
                          "switch one on or drop tri_accel")
    _check_numbers(opts)
    need = min_side(plan.config.train)
    if opts.curv_crop and opts.curv_crop < need:
        raise ConfigError(f"tri_accel:curv_crop={opts.curv_crop} is below the {need} px the loss "
                          "needs; raise it or use curv_crop=0 (full image)")
    cpu = plan.device.type != "cuda"
    if opts.precision and opts.low == "fp16" and cpu:
        raise ConfigError("tri_accel:low=fp16 needs a CUDA GPU; on the CPU use tri_accel:low=bf16 "
                          "(BF16 becomes the lowest tier) or train.device=cuda")
    if opts.stats == "triton" and cpu:
        raise ConfigError("tri_accel:stats=triton needs a CUDA GPU; use stats=auto or stats=torch")
    if opts.elastic and cpu and plan.config.budget is None:
        raise ConfigError("tri_accel:elastic=on on the CPU needs a memory budget to steer by; set "
                          "budget (e.g. budget=\"600MiB\") or elastic=off")
    if plan.config.world_size > 1:
        raise ConfigError("tri_accel is single-device; set world_size=1")
    for name in plan.chosen:
        if name == "amp" and opts.precision:
            raise ConfigError("tri_accel sets each unit's precision itself; drop amp or use "
                              "tri_accel:precision=off with amp")
        if get_technique(name).stage in (Stage.COMPILE, Stage.PARALLEL):
            raise ConfigError(f"tri_accel changes precision, learning rates and batch size at run "
                              f"time and owns the optimizer; it cannot be combined with {name}")


def _check_numbers(o: Options) -> None:
    positive = ("t_ctrl", "t_curv", "b_curv", "top_k", "power_iters", "delta_up", "delta_down",
                "max_batch")
    for name in positive:
        if getattr(o, name) < 1:
            raise ConfigError(f"tri_accel:{name} must be >= 1 (got {getattr(o, name)})")
    if o.curvature and o.t_curv % o.t_ctrl:
        raise ConfigError(f"tri_accel:t_curv={o.t_curv} must be a multiple of t_ctrl={o.t_ctrl}")
    if not 0 <= o.beta < 1:
        raise ConfigError(f"tri_accel:beta must be in [0, 1) (got {o.beta})")
    if not 0 <= o.tau_low <= o.tau_high:
        raise ConfigError(f"tri_accel: need 0 <= tau_low <= tau_high (got {o.tau_low}, {o.tau_high})")
    if not 0 < o.rho_low < o.rho_high <= 1:
        raise ConfigError(f"tri_accel: need 0 < rho_low < rho_high <= 1 (got {o.rho_low}, {o.rho_high})")
    if o.curv_crop and (o.curv_crop < 32 or o.curv_crop % 32):
        raise ConfigError(f"tri_accel:curv_crop={o.curv_crop} must be 0 or a multiple of 32")
    if o.alpha < 0:
        raise ConfigError(f"tri_accel:alpha must be >= 0 (got {o.alpha})")
    if not 0 < o.curv_budget <= 1:
        raise ConfigError(f"tri_accel:curv_budget must be in (0, 1] (got {o.curv_budget})")


def apply(opts: Options, build: Build) -> None:
    from memstudy.techniques.tri_accel.controller import TriAccelController

    controller = TriAccelController(opts, build)
    build.notes["tri_accel_units"] = [u.name for u in controller.units]


register(Technique("tri_accel", Stage.RUNTIME, Options,
                   "per-unit adaptive precision + curvature-scaled LR + elastic batch (Tri-Accel)",
                   apply, check, order=20,
                   sets_learning_rate="sets every unit's learning rate at each control step",
                   varies_batch=lambda o: o.elastic))
