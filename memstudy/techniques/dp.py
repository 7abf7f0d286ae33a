"""Data parallelism: torch DistributedDataParallel, one process per GPU.

Memory / compute trade-off: every rank keeps a full replica of parameters, gradients and
optimizer state, plus DDP's gradient buckets (about one more copy of the gradients), so
per-GPU memory is the single-GPU memory of batch_size / N images *plus* the buckets: DP
does not lower the persistent memory, it lowers the activation memory per GPU by
splitting the global batch (train.batch_size) over the N ranks. Time: the all-reduce of
gradients overlaps the backward; an epoch takes about 1/N of the steps.

The training set is split per epoch as DistributedSampler does (rank r takes every N-th
image of each shuffled global batch); an incomplete last global batch is dropped. Batch
norm statistics are per rank (as in the study): gradients equal those of one process only
up to that difference (tests/test_distributed.py checks both facts).
"""
from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from memstudy.distributed import context
from memstudy.errors import ConfigError
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import DpOptions as Options


def check(opts: Options, plan: Plan) -> None:
    if plan.has("mp") and plan.chosen["mp"].mode == "local":
        raise ConfigError("dp with mp:mode=local (model parallel inside one process) is not "
                          "supported: drop dp, or use mp:mode=process without dp")
    if plan.has("fsdp"):
        raise ConfigError("fsdp is itself data parallel (it shards what dp replicates): drop dp")
    if plan.config.train.warmup_steps < 2:
        # DDP rebuilds its gradient buckets (a gradient-sized allocation) in the forward of
        # the second step; measured, it would add the parameters' size to that forward.
        raise ConfigError(f"dp needs train.warmup_steps >= 2 (got "
                          f"{plan.config.train.warmup_steps}): DDP reallocates its gradient "
                          "buckets in the second step; set --set train.warmup_steps=2")
    context.check_world(plan, "dp")
    context.check_batch_divides(plan, "dp")
    context.resolve_backend(opts.backend, plan.device, "dp", gloo_on_cuda=True)


def apply(opts: Options, build: Build) -> None:
    context.shard_batch(build)
    ids = [build.device.index] if build.device.type == "cuda" else None
    build.model = DistributedDataParallel(build.model, device_ids=ids)
    build.notes["dp"] = {"world_size": context.world_size(), "per_rank_batch": build.runtime.batch_size}


register(Technique("dp", Stage.PARALLEL, Options,
                   "data parallel (DDP): global batch split over ranks, full replica per GPU",
                   apply, check, order=10, shards_batch=True, owns_process_group=True,
                   gloo_on_cuda=True))  # DDP's all-reduce works over gloo with CUDA tensors
