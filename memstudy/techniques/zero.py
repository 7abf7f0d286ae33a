"""ZeRO stage 1: torch.distributed.optim.ZeroRedundancyOptimizer over data parallelism.

Memory / compute trade-off: each rank keeps the optimizer state (Adam: two moments, 8 bytes
per parameter) of about 1/N of the parameters instead of all of them; parameters and
gradients stay replicated. After the local step, each rank broadcasts its updated
parameters: one extra parameter-sized communication per step. With 24M parameters and two
GPUs this saves ~96 MB per GPU: small next to the activations of large images, which is
what the study saw ("ZeRO slightly reduces memory").
"""
from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from memstudy.errors import ConfigError
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import ZeroOptions as Options


def check(opts: Options, plan: Plan) -> None:
    if plan.has("fsdp"):
        raise ConfigError("zero with fsdp: fsdp already shards the optimizer state; drop zero")
    if not plan.has("dp"):
        raise ConfigError("zero shards the optimizer state over data-parallel ranks and needs "
                          "dp: use techniques dp,zero with world_size >= 2")


def sharded(factory):
    """Wrap an optimizer factory: same optimizer class and settings, state sharded."""
    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        inner = factory(model)  # built only to read its class and settings; holds no state
        if len(inner.param_groups) != 1:
            raise ConfigError("zero supports one parameter group; the optimizer factory made "
                              f"{len(inner.param_groups)}")
        params = inner.param_groups[0]["params"]
        opt = ZeroRedundancyOptimizer(params, optimizer_class=type(inner), **inner.defaults)
        # ZeroRedundancyOptimizer keeps its own `state` empty; pointing it at the local
        # optimizer's state lets the meters count this rank's shard (cat_optimizer_bytes).
        opt.state = opt.optim.state
        return opt
    return make


def apply(opts: Options, build: Build) -> None:
    build.runtime.optimizer_factory = sharded(build.runtime.optimizer_factory)


register(Technique("zero", Stage.PARALLEL, Options,
                   "ZeRO-1: optimizer state sharded over dp ranks (ZeroRedundancyOptimizer)",
                   apply, check, order=20))  # after dp: wraps the optimizer factory
