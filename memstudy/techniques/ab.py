"""ab: AB training ([Coquelin] (docs/references.md) chapter 5, Algorithm 2) on the data-parallel ranks of `dp`.

After `warmup` full-rank DP steps, every eligible weight W becomes A B (A = U Sigma^1/2,
B = Sigma^1/2 V^T, ranks with singular values below sigma_cutoff * the largest dropped); half
the ranks train A, the other half B, each half averaging its gradients only inside itself
(DDP's all-reduce is off) for `ab_steps` steps; then A and B are averaged over all ranks and
W <- A B; `rebound` full-rank DP steps follow, and the cycle repeats.

Memory / compute trade-off: during the AB phase each rank trains and keeps optimizer state for
one factor (m k or k n elements instead of m n) and holds both factors plus the full weight it
will be written back into (the Parameter DDP owns stays allocated: m n + (m + n) k per weight,
more than dp alone); the weight is rebuilt in every forward (one m x k x n product per layer).
What it buys is communication: inside the AB phase each rank all-reduces only its group's
trained factors and the small full-rank parameters, within half the ranks; the full-rank
gradients are not exchanged until the synchronisation, which sends A and B once. The
learning-rate rebound of section 5.2 is not implemented (optimizer state is reset at every
change of shape, the LR is left as scheduled). docs/techniques/ab.md has the rest.

Recorded per step (run `series`): `ab_comm_bytes` (payload bytes this rank put into gradient
or parameter collectives; in DP steps the gradient bytes DDP all-reduces), `ab_rank_sum` at
each decomposition and `ab_sync` at each synchronisation.
"""
from __future__ import annotations

from memstudy.errors import ConfigError
from memstudy.techniques import planned_steps, register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import AbOptions as Options

COMPOSES_WITH = ("dp", "amp", "checkpoint", "offload")


def resolved(opts: Options, config) -> tuple[int, int, int]:
    steps = planned_steps(config, config.data.train_images)
    warmup = steps // 5 if opts.warmup is None else opts.warmup
    ab_steps = max(1, round(steps / 30)) if opts.ab_steps is None else opts.ab_steps
    rebound = max(1, ab_steps // 4) if opts.rebound is None else opts.rebound
    return warmup, ab_steps, rebound


def check(opts: Options, plan: Plan) -> None:
    if not plan.has("dp"):
        raise ConfigError("ab trains groups of data-parallel ranks: add dp to techniques "
                          "(e.g. techniques = [\"dp\", \"ab\"], world_size >= 2)")
    if plan.config.world_size < 2:
        raise ConfigError(f"ab needs world_size >= 2 (one A and one B group; got "
                          f"{plan.config.world_size})")
    if not 0 < opts.sigma_cutoff < 1:
        raise ConfigError(f"ab:sigma_cutoff must be in (0, 1) (got {opts.sigma_cutoff})")
    warmup, ab_steps, rebound = resolved(opts, plan.config)
    if ab_steps < 1:
        raise ConfigError(f"ab:ab_steps must be >= 1 (got {ab_steps})")
    if warmup < 0 or rebound < 0:
        raise ConfigError(f"ab:warmup and ab:rebound must be >= 0 (got {warmup}, {rebound})")
    steps = planned_steps(plan.config, plan.config.data.train_images, chosen=plan.chosen)
    if warmup + ab_steps > steps:
        raise ConfigError(f"ab:warmup={warmup} + ab:ab_steps={ab_steps} exceed the run's {steps} "
                          "steps: no AB phase would finish; lower them or train longer")
    for name in plan.chosen:
        if name != "ab" and name not in COMPOSES_WITH:
            raise ConfigError(f"ab replaces weights by A / B factors during the run; {name} is not "
                              f"known to follow that (ab composes with {', '.join(COMPOSES_WITH)}): "
                              f"drop {name} or ab")


def apply(opts: Options, build: Build) -> None:
    from memstudy.distributed import context
    from memstudy.lowrank.ab_training import ABSchedule

    ddp = build.model
    warmup, ab_steps, rebound = resolved(opts, build.config)
    schedule = ABSchedule(ddp.module, ddp, warmup, ab_steps, rebound, opts.sigma_cutoff,
                          opts.skip_first, opts.skip_last, context.rank(), context.world_size(),
                          total=planned_steps(build.config, build.config.data.train_images,
                                              chosen=build.plan.chosen))
    rt, factory = build.runtime, build.runtime.optimizer_factory

    def optimizer_with_groups(model):
        optimizer = factory(model)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: schedule.before_step(opt))
        return optimizer

    rt.optimizer_factory = optimizer_with_groups
    rt.forward_contexts.append(schedule.forward_context)
    rt.step_hooks.append(lambda info: schedule.after_step(info.step, info.optimizer))
    rt.series_sources.append(schedule.series)
    build.notes["ab"] = {"warmup": warmup, "ab_steps": ab_steps, "rebound": rebound,
                         "group": "A" if schedule.train_a else "B"}


register(Technique("ab", Stage.RUNTIME, Options,
                   "AB training: half the dp ranks train A, half B of W = AB, averaged and "
                   "rebound to full rank ([Coquelin] ch. 5)", apply, check))
