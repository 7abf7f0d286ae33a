"""Activation checkpointing: keep fewer activations in forward, recompute them in backward.

Memory / compute trade-off: a checkpointed region keeps only its inputs for backward (plus,
with `selective`, the outputs the policy saves); everything else it computed is dropped and
recomputed, region by region, when backward reaches it. Forward memory falls by roughly the
activations inside regions; backward pays one extra forward of every region (the forward is
about a third of a step, so expect up to ~+1/3 step time; less with `selective`, which
recomputes no convolution) and holds one region's activations at a time while recomputing. Non-reentrant `torch.utils.checkpoint` is used throughout.

Placements (positional option `placement`):
- `block`: every residual block of layer1..layer4 and every decoder block is one region. The
  stem (conv1 + bn1 at half resolution) and the max-pool indices stay saved.
- `sqrt`: Chen et al.'s sqrt(L) rule ([Compute-Opt] III.E, docs/references.md). The network is a chain of L units:
  the stem, each residual block (the max-pool joins layer1's first block) and each decoder
  block (L = 1 + 16 + 5 = 22 for the ResNet-34 U-Net). Unit i belongs to even segment
  i * k // L, k = `segments` (0: round(sqrt(L)) = 5). The U-Net's skip connections decide
  the rest: every encoder stage output (stem, layer1..layer4) is consumed by a decoder block,
  so it must stay alive until backward anyway. Cutting a region there is free, so encoder
  regions never span a stage: each is a run of one stage's units within one segment, and its
  output - the stage output where it ends a stage - is the checkpoint's output, which the
  decoder receives as its skip. Decoder blocks, in contrast, hand only their output to the next
  block, so a decoder region runs several blocks and takes their skip features as inputs
  (already alive; nothing extra kept). To run regions that group modules which smp calls one
  by one, the encoder's and decoder's `forward` are replaced on the instances by
  `_encoder_forward` / `_decoder_forward`, which follow smp 0.6's ResNetEncoder / UnetDecoder
  step for step (the gradient test against the plain model guards this); other encoders or
  decoders are refused.
- `selective`: regions as in `block`, with a per-op policy
  (`create_selective_checkpoint_contexts`): convolution outputs are saved (MUST_SAVE) and
  everything else - BatchNorm, ReLU, additions, up-sampling - recomputed (PREFER_RECOMPUTE).
  Backward recomputes only the cheap ops; memory sits between plain and `block`.

BatchNorm: recomputation runs the BatchNorm layers of a region again in training mode, which
would update running_mean / running_var / num_batches_tracked a second time per step. The
recompute context (checkpoint's `context_fn` gives the forward and the recomputation separate
contexts) runs them with momentum 0 and their batch counter detached: they normalise with the
batch's own statistics, as the forward did, and rewrite the running buffers with their own
values, so the running statistics equal the plain model's exactly and the recomputation
launches no kernel the forward did not (an earlier version cloned and restored the buffers:
270 extra small kernels per step on the ResNet-34 U-Net, on the backward's critical path).
Fake quantizers (`quantization`) likewise keep the scales their forward observed.

What torch.utils.checkpoint does by default and memstudy leaves out (eager mode): stashing and
restoring the CPU and CUDA random-number state around every region (`preserve_rng_state`) is
done only for regions holding a module that draws random numbers (dropout, RReLU); the
U-Net's blocks draw none. The metadata check of every recomputed tensor
(`determinism_check`) is off; the gradient tests against the plain model guard the
recomputation instead. Both are per-region host work on the backward's critical path.

Each region's forward and recomputation run inside the run's `Runtime.checkpoint_regions`
(a counter), so that ops which would spend work saving less (compress's ReLU sign masks) know that what they
save here is discarded or short-lived. Modules are not replaced (only `forward` of instances
is patched), so parameter names and state_dict keys are unchanged. A run of `invertible`'s
momentum blocks is one region (not under `selective`); other blocks that are not plain ResNet
blocks are left unwrapped and listed in the run's notes.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch
from segmentation_models_pytorch.decoders.unet.decoder import UnetDecoder
from segmentation_models_pytorch.encoders.resnet import ResNetEncoder
from torch import nn
from torch.ao.quantization import FakeQuantizeBase
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)
from torchvision.models.resnet import BasicBlock, Bottleneck

from memstudy.errors import ConfigError
from memstudy.models import top_level_modules
from memstudy.network import encoder_of
from memstudy.runtime import CheckpointRegions, mark_boundary
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import CheckpointOptions as Options
from memstudy.techniques.invertible import MomentumBlocks

SAVED_OPS = {torch.ops.aten.convolution.default}  # `selective` keeps these outputs
# modules that draw random numbers in training: only regions holding one need the RNG state
# stashed in forward and restored for the recomputation (preserve_rng_state)
RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU)


def check(opts: Options, plan: Plan) -> None:
    splitters = plan.declaring("splits_model")
    if opts.placement == "sqrt" and splitters:
        raise ConfigError(f"checkpoint:sqrt chains the whole U-Net, which {splitters[0]} splits "
                          f"over two devices; use checkpoint:block (or selective) with "
                          f"{splitters[0]}")
    if opts.segments and opts.placement != "sqrt":
        raise ConfigError(f"checkpoint: segments applies only to placement=sqrt (got "
                          f"placement={opts.placement}); drop segments or use checkpoint:sqrt")
    units = unet_units(plan.config.model)
    if units and not 0 <= opts.segments <= units:
        raise ConfigError(f"checkpoint: segments={opts.segments} must be 0 (= sqrt of the unit "
                          f"count) or 1..{units}, the {plan.config.model.describe()}'s units")
    if opts.modules and opts.placement != "modules":
        raise ConfigError(f"checkpoint: modules applies only to placement=modules (got "
                          f"placement={opts.placement}); drop modules or use "
                          "checkpoint:modules:modules=...")


def unet_units(network) -> int:
    """The units `sqrt` segments: stem, residual blocks, decoder blocks; 0 for a user's own
    network (model.factory), which has none."""
    encoder = encoder_of(network)
    return 0 if encoder is None else 1 + sum(encoder.layers) + len(network.decoder_channels)


def needs_unet(opts: Options) -> str | bool:
    if opts.placement == "modules":
        return False
    return (f"(placement={opts.placement}) checkpoints the U-Net's residual and decoder blocks "
            "(checkpoint:modules checkpoints any network's top-level or named modules)")


# -- running a region under checkpoint ------------------------------------------------------
def _save_convolutions(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _recomputed_bns(modules: list[nn.Module]) -> list[nn.modules.batchnorm._BatchNorm]:
    return [bn for m in modules for bn in m.modules()
            if isinstance(bn, nn.modules.batchnorm._BatchNorm) and bn.training
            and bn.track_running_stats]


@contextlib.contextmanager
def running_stats_untouched(modules: list[nn.Module]):
    """Inside, training-mode BatchNorm layers normalise with batch statistics (as they did in the
    forward) and leave their running buffers as they are; fake quantizers keep their scales.

    Momentum 0 makes BatchNorm's fused update write running = 1 * running + 0 * batch, the
    same values, inside the kernel it launches anyway, and with the batch counter detached
    (None) it is not advanced: Python attributes only, no kernel added. (Turning
    `track_running_stats` off instead would drop the running buffers from what BatchNorm
    saves for backward, and checkpoint refuses a recomputation that saves fewer tensors.)"""
    bns = _recomputed_bns(modules)
    saved = [(bn, bn.momentum, bn.num_batches_tracked) for bn in bns]
    observers = [(fq, fq.observer_enabled.clone()) for m in modules for fq in m.modules()
                 if isinstance(fq, FakeQuantizeBase)]
    for bn in bns:
        bn.momentum, bn.num_batches_tracked = 0.0, None
    for fq, _ in observers:
        fq.disable_observer()
    try:
        yield
    finally:  # also when checkpoint's early stop interrupts the recomputation
        for bn, momentum, counter in saved:
            bn.momentum, bn.num_batches_tracked = momentum, counter
        for fq, enabled in observers:
            fq.observer_enabled.copy_(enabled)


@contextlib.contextmanager
def _recompute_context(modules: list[nn.Module], inner):
    with running_stats_untouched(modules), inner:
        yield


def draws_random(modules: list[nn.Module]) -> bool:
    return any(isinstance(m, RANDOM_MODULES) for module in modules for m in module.modules())


def _contexts(modules: list[nn.Module], selective: bool):
    forward, recompute = (create_selective_checkpoint_contexts(_save_convolutions) if selective
                          else (contextlib.nullcontext(), contextlib.nullcontext()))
    return forward, _recompute_context(modules, recompute)


def checkpointed_call(fn: Callable, modules: list[nn.Module], selective: bool,
                      regions: CheckpointRegions, *args, **kwargs):
    """fn(*args, **kwargs) as one non-reentrant checkpoint region over `modules`, counted in
    `regions` while it runs (forward and recomputation)."""
    if not torch.is_grad_enabled():  # validation: nothing is saved, nothing to recompute
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        # Under torch.compile (`compile`), context_fn must return dispatch modes, and the
        # compiled graph applies BatchNorm's buffer updates once (functionalized; the
        # recomputation happens inside the compiled backward): no recompute context needed.
        # tests/test_tech_compile.py checks gradients and running statistics against eager.
        context_fn = (functools.partial(create_selective_checkpoint_contexts, _save_convolutions)
                      if selective else None)
    else:
        context_fn = functools.partial(_contexts, modules, selective)
        # the region's inputs are what it keeps for backward: compress / offload with
        # which=boundaries act on these tensors only
        mark_boundary(*args, *kwargs.values())
    # respect_saved_tensors_hooks: tensors `selective` keeps go through the runtime's
    # saved-tensor hooks like any other saved tensor (the meters count them, offload moves them).
    # Older torch (before the option existed) keeps them outside the hooks: the meters then
    # miss what `selective` saves, and the run's notes say so.
    extra = {"respect_saved_tensors_hooks": True} if _HAS_RESPECT_HOOKS else {}
    if not torch.compiler.is_compiling():  # host work per region that the U-Net does not need
        extra.update(preserve_rng_state=draws_random(modules), determinism_check="none")
        fn = functools.partial(_in_region, regions, fn)
    if context_fn is not None:  # TorchDynamo refuses noop_context_fn passed explicitly
        extra["context_fn"] = context_fn
    return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)


def _in_region(regions: CheckpointRegions, fn: Callable, *args, **kwargs):
    """fn run as a checkpoint region: in forward and again in the recomputation."""
    with regions.running():
        return fn(*args, **kwargs)


_HAS_RESPECT_HOOKS = "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters


def checkpoint_module(module: nn.Module, selective: bool = False,
                      regions: CheckpointRegions | None = None) -> None:
    """Make every call of `module` a checkpoint region (its instance `forward` is replaced)."""
    original, regions = module.forward, regions or CheckpointRegions()

    def forward(*args, **kwargs):
        return checkpointed_call(original, [module], selective, regions, *args, **kwargs)

    module.forward = forward


def is_plain_block(module: nn.Module) -> bool:
    return isinstance(module, (BasicBlock, Bottleneck))


def is_region(module: nn.Module, selective: bool = False) -> bool:
    """A residual block, or a run of `invertible`'s momentum blocks (not under `selective`: its
    per-op policy would keep convolution outputs computed inside momentumnet's no-grad forward)."""
    return is_plain_block(module) or (isinstance(module, MomentumBlocks) and not selective)


# -- placements ------------------------------------------------------------------------------
def apply_per_block(model: nn.Module, selective: bool, regions: CheckpointRegions | None = None
                    ) -> tuple[list[str], list[str]]:
    """`block` / `selective`: each residual block and decoder block; returns (wrapped, skipped).
    `regions` counts the regions running (the run's Runtime.checkpoint_regions)."""
    regions = regions or CheckpointRegions()
    wrapped, skipped = [], []
    for stage_name, stage in zip(model.residual_stage_names, model.residual_stages):
        for i, block in enumerate(stage):
            region = is_region(block, selective)
            (wrapped if region else skipped).append(f"encoder.{stage_name}.{i}")
            if region:
                checkpoint_module(block, selective, regions)
    for i, block in enumerate(model.decoder_blocks):
        checkpoint_module(block, selective, regions)
        wrapped.append(f"decoder.blocks.{i}")
    return wrapped, skipped


@dataclass
class Unit:
    name: str
    modules: list[nn.Module]  # run one after the other
    group: int  # encoder stage 0..4 (stem, layer1..layer4), or 5 for the decoder
    checkpointable: bool = True


def chain_units(model: nn.Module) -> list[Unit]:
    """The network as the chain of units that `sqrt` segments."""
    enc = model.encoder
    units = [Unit("stem", [enc.conv1, enc.bn1, enc.relu], 0)]
    for g, (name, stage) in enumerate(zip(model.residual_stage_names, model.residual_stages), 1):
        for i, block in enumerate(stage):
            modules = [enc.maxpool, block] if g == 1 and i == 0 else [block]
            units.append(Unit(f"{name}.{i}", modules, g, is_region(block)))
    decoder_group = len(model.residual_stages) + 1
    units += [Unit(f"decoder.{i}", [b], decoder_group) for i, b in enumerate(model.decoder_blocks)]
    return units


def sqrt_regions(units: list[Unit], segments: int) -> list[list[Unit]]:
    """Maximal runs of units sharing even segment i * k // L, group, and checkpointability."""
    regions: list[list[Unit]] = []
    key = None
    for i, unit in enumerate(units):
        new_key = (i * segments // len(units), unit.group, unit.checkpointable)
        if new_key != key or not unit.checkpointable:
            regions.append([])
        regions[-1].append(unit)
        key = new_key
    return regions


def _run_sequence(modules: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for module in modules:
        x = module(x)
    return x


def _run_decoder_blocks(blocks: list[nn.Module], sizes: list[tuple[int, int]], x: torch.Tensor,
                        *skips: torch.Tensor | None) -> torch.Tensor:
    for block, (height, width), skip in zip(blocks, sizes, skips):
        x = block(x, height, width, skip_connection=skip)
    return x


def _encoder_forward(stages: list[list[list[Unit]]], running: CheckpointRegions,
                     x: torch.Tensor) -> list[torch.Tensor]:
    """smp 0.6 ResNetEncoder.forward (depth 5): [input, stem, layer1..layer4] outputs."""
    features = [x]
    for regions in stages:
        for region in regions:
            modules = [m for unit in region for m in unit.modules]
            x = (checkpointed_call(_run_sequence, modules, False, running, modules, x)
                 if region[0].checkpointable else _run_sequence(modules, x))
        features.append(x)
    return features


def _decoder_forward(decoder: nn.Module, regions: list[list[int]], running: CheckpointRegions,
                     features: list[torch.Tensor]) -> torch.Tensor:
    """smp 0.6 UnetDecoder.forward with the blocks of each region run as one checkpoint."""
    shapes = [f.shape[2:] for f in features][::-1]
    features = features[1:][::-1]  # drop the full-resolution input; start from the deepest
    head, skips = features[0], features[1:]
    x = decoder.center(head)
    for region in regions:
        blocks = [decoder.blocks[i] for i in region]
        sizes = [tuple(shapes[i + 1]) for i in region]
        region_skips = [skips[i] if i < len(skips) else None for i in region]
        x = checkpointed_call(_run_decoder_blocks, blocks, False, running, blocks, sizes, x,
                              *region_skips)
    return x


def apply_sqrt(model: nn.Module, segments: int, running: CheckpointRegions
               ) -> tuple[list[str], list[str], int]:
    enc, dec = model.encoder, model.decoder
    if not (isinstance(enc, ResNetEncoder) and enc._depth == 5 and type(dec) is UnetDecoder):
        raise ConfigError(f"checkpoint:sqrt rebuilds smp's ResNet encoder / UnetDecoder forward "
                          f"and got {type(enc).__name__} / {type(dec).__name__}; use "
                          "checkpoint:block")
    units = chain_units(model)
    k = segments or round(math.sqrt(len(units)))
    if k > len(units):
        raise ConfigError(f"checkpoint: segments={k} exceeds the model's {len(units)} units")
    regions = sqrt_regions(units, k)
    decoder_group = units[-1].group
    stages = [[r for r in regions if r[0].group == g] for g in range(decoder_group)]
    decoder_regions = [[int(u.name.split(".")[1]) for u in r] for r in regions
                       if r[0].group == decoder_group]
    enc.forward = functools.partial(_encoder_forward, stages, running)
    dec.forward = functools.partial(_decoder_forward, dec, decoder_regions, running)
    wrapped = ["+".join(u.name for u in r) for r in regions if r[0].checkpointable]
    skipped = [r[0].name for r in regions if not r[0].checkpointable]
    return wrapped, skipped, k


def apply_per_module(model: nn.Module, names: str, regions: CheckpointRegions
                     ) -> tuple[list[str], list[str]]:
    """`modules`: each named module (every top-level one with parameters by default) a region."""
    if names:
        chosen = [(name, _submodule(model, name)) for name in names.split("+")]
    else:
        chosen = top_level_modules(model)
    for _, module in chosen:
        checkpoint_module(module, False, regions)
    return [name for name, _ in chosen], []


def _submodule(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        children = [n for n, _ in model.named_children()]
        raise ConfigError(f"checkpoint:modules names {name!r}, which the "
                          f"{type(model).__name__} does not have; its top-level modules are "
                          f"{children}") from None


def apply(opts: Options, build: Build) -> None:
    model = build.model
    if opts.placement == "modules":
        wrapped, skipped = apply_per_module(model, opts.modules, build.runtime.checkpoint_regions)
    elif opts.placement == "sqrt":
        wrapped, skipped, k = apply_sqrt(model, opts.segments, build.runtime.checkpoint_regions)
        build.notes["checkpoint_segments"] = k
    else:
        wrapped, skipped = apply_per_block(model, opts.placement == "selective",
                                           build.runtime.checkpoint_regions)
    build.notes["checkpoint_regions"] = wrapped
    if skipped:
        build.notes["checkpoint_not_wrapped"] = skipped


register(Technique("checkpoint", Stage.ACTIVATION, Options,
                   "recompute activations in backward: less forward memory, ~1 extra forward",
                   apply, check, order=20, needs_unet=needs_unet))
