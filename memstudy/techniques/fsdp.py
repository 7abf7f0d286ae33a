"""Fully sharded data parallelism: FSDP2 (`torch.distributed.fsdp.fully_shard`).

Memory / compute trade-off, per rank of N:
- mode=grad_op (ZeRO-2-like, reshard_after_forward=False): parameters are gathered once per
  step and kept unsharded from forward through backward; gradients (reduce-scatter) and
  optimizer state are held as 1/N shards. Communication: one all-gather + one
  reduce-scatter of the parameters per step.
- mode=full (ZeRO-3-like, reshard_after_forward=True): parameters are also freed after each
  block's forward and gathered again for its backward, so only one block's parameters are
  whole at a time; one more all-gather per step.
Shards are per encoder residual stage and per decoder block, then the root (stem, head),
so the gather granularity follows the U-Net's blocks. Data are split as in dp.
"""
from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from memstudy.distributed import context, p2p
from memstudy.errors import ConfigError
from memstudy.models import top_level_modules
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import FsdpOptions as Options
from memstudy.tiling.validation import UNTILED_REASON


def check(opts: Options, plan: Plan) -> None:
    if plan.has("zero"):
        raise ConfigError("fsdp with zero: fsdp already shards the optimizer state; drop zero")
    if plan.has("dp"):
        raise ConfigError("fsdp is itself data parallel (it shards what dp replicates): drop dp")
    context.check_world(plan, "fsdp")
    context.check_batch_divides(plan, "fsdp")
    context.resolve_backend(opts.backend, plan.device, "fsdp", gloo_on_cuda=False)


def apply(opts: Options, build: Build) -> None:
    model = build.model
    blocks = [*getattr(model, "residual_stages", []), *getattr(model, "decoder_blocks", [])]
    if not blocks:  # a user's own network (model.factory): a unit per top-level module
        blocks = [child for _, child in top_level_modules(model)]
    if not blocks:
        raise ConfigError(f"fsdp shards per module but the {type(model).__name__} has no child "
                          "module with parameters; drop fsdp")
    context.shard_batch(build)
    mesh = init_device_mesh(build.device.type, (context.world_size(),))
    reshard = opts.mode == "full"
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    build.runtime.loss_fn = _overflow_synchronised(build.runtime)
    # each block's parameters are gathered in the block's forward, which the tiled validation
    # walk (it calls the blocks' layers itself) would bypass
    setattr(model, UNTILED_REASON, "fsdp gathers a block's parameters in the block's forward, "
            "which the tiled walk would bypass")
    build.notes["fsdp"] = {"mode": opts.mode, "units": len(blocks) + 1}


def _overflow_synchronised(runtime):
    """Each rank unscales only its gradient shards: with amp:fp16 the ranks must agree on
    skipping a step (the GradScaler is installed later, by amp, so this is done lazily)."""
    base = runtime.loss_fn

    def loss_fn(out, target):
        if runtime.scaler is not None:
            p2p.synchronise_overflow(runtime.scaler)
        return base(out, target)

    return loss_fn


register(Technique("fsdp", Stage.PARALLEL, Options,
                   "FSDP2: parameters/gradients/optimizer state sharded (full) or "
                   "gradients/optimizer state sharded (grad_op)", apply, check,
                   order=10, shards_batch=True, owns_process_group=True, splits_gradients=True,
                   contiguous_weights=True))
