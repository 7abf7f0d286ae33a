"""invertible: Momentum ResNet (MomentumNet) blocks in the encoder, activations rebuilt in backward.

Trade-off: a run of shape-preserving residual blocks f_1..f_n becomes the momentum iteration
    v <- gamma * v + (1 - gamma) * (f_t(x) - x);   x <- x + v
which can be inverted in closed form, so with `memory_saving=true` (momentumnet's
`use_backprop=False`) the stage keeps only its output x and the velocity v for backward and
rebuilds every block's input while going backwards, re-running each block once more.
Memory: the saved activations of n blocks (about five feature maps each) are replaced by one
feature map plus the velocity in momentumnet's exact fixed-point form (two int64 tensors, i.e.
four float32 maps). Compute: one extra forward of every converted block in backward.

This changes the function: with gamma > 0 the network is a Momentum ResNet, not ResNet-34
(gamma = 0 would be ResNet-34 exactly, but cannot be inverted: backward divides by gamma).
Blocks that change shape (the first block of layer2..layer4: stride 2 and a downsample
projection) are not invertible and stay ordinary blocks. On ResNet-34 that converts:
    layer1 blocks 0-2, layer2 blocks 1-3, layer3 blocks 1-5, layer4 blocks 1-2 (13 of 16).

Two corrections to plain momentumnet, both in `_Replayable`:
- BatchNorm: rebuilding a block in backward runs its BatchNorm layers again in training mode,
  which would update their running statistics twice per step. During the rebuild the
  running statistics are left untouched (momentum 0, batch counter restored); likewise the
  observers of `quantization`'s fake quantizers, whose scales were set in the forward.
- Autocast: the rebuild runs inside the autograd backward, where autocast is off; it re-enters
  the autocast state of the forward so the rebuilt block computes what the forward computed
  (otherwise a bf16 forward and a float32 rebuild disagree and the velocity drifts).
Reconstruction is not bit-exact in floating point (x_t = x_{t+1} - v), so gradients differ
from backpropagation through the same momentum network by rounding; docs/techniques/invertible.md
gives the measured difference.

With `amp:fp16` (memory-saving mode) a float16 input enters each momentum run in float32
(`velocity_input`): momentumnet stores the velocity in fixed point, int64(v * 2**52), and
computes v * 2**52 in v's own dtype; in float16 every nonzero value overflows to inf and the
int64 conversion saturates, so the first block of every run added |v| = 2048 to its
activations and the float16 convolutions after it overflowed later in training (docs/paper.md,
"Why AMP with Momentum-Net diverges"). The blocks' convolutions still run in float16 under
autocast; only the residual stream and the velocity are float32, as they already were after a
run's first block. Cost: one transient float32 copy of each run's input.
"""
from __future__ import annotations

import contextlib

import torch
from momentumnet import MomentumNet
from torch import nn
from torch.ao.quantization import FakeQuantizeBase

from memstudy.errors import ConfigError
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import InvertibleOptions as Options


class _Replayable(nn.Module):
    """One residual block; when called again after the forward (the backward rebuild), it
    re-enters the forward's autocast state and leaves BatchNorm running statistics alone."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.replay_autocast: tuple[str, bool, torch.dtype] | None = None  # None: in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.replay_autocast is None:
            return self.block(x)
        device_type, enabled, dtype = self.replay_autocast
        autocast = torch.autocast(device_type, dtype=dtype, enabled=enabled)
        with autocast, _frozen_bn_stats(self.block):
            return self.block(x)


@contextlib.contextmanager
def _frozen_bn_stats(module: nn.Module):
    """BatchNorm still normalises with batch statistics, but its running ones do not move;
    fake-quantization observers (the `quantization` technique) keep the forward's scales."""
    saved, observers = [], []
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats:
            saved.append((m, m.momentum, m.num_batches_tracked.clone()))
            m.momentum = 0.0  # running = (1 - 0) * running + 0 * batch
        elif isinstance(m, FakeQuantizeBase):
            observers.append((m, m.observer_enabled.clone()))
            m.disable_observer()
    try:
        yield
    finally:
        for bn, momentum, count in saved:
            bn.momentum = momentum
            bn.num_batches_tracked.copy_(count)
        for fq, enabled in observers:
            fq.observer_enabled.copy_(enabled)


class MomentumBlocks(nn.Module):
    """A run of shape-preserving residual blocks executed as one MomentumNet."""

    def __init__(self, blocks: list[nn.Module], gamma: float, memory_saving: bool):
        super().__init__()
        self.momentum = MomentumNet([_Replayable(b) for b in blocks], gamma=gamma,
                                    use_backprop=not memory_saving, is_residual=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.momentum.functions
        for block in blocks:
            block.replay_autocast = None
        try:
            out = self.momentum(velocity_input(x) if not self.momentum.use_backprop else x)
        finally:
            # also when the forward is cut short: checkpoint's recomputation of this run stops
            # (by an exception) once momentumnet has saved its tensors, and the rebuild that
            # follows must still find the blocks in replay mode (frozen BatchNorm statistics)
            state = (x.device.type, torch.is_autocast_enabled(x.device.type),
                     torch.get_autocast_dtype(x.device.type))
            for block in blocks:
                block.replay_autocast = state
        # momentumnet keeps its initial (zero) velocity on the module: drop it, so a full-size
        # feature map does not stay alive between steps.
        if hasattr(self.momentum.network, "v"):
            self.momentum.network.v = None
        return out


def velocity_input(x: torch.Tensor) -> torch.Tensor:
    """A run's input as momentumnet's fixed-point velocity needs it: float16 becomes float32
    (float16 * 2**52 is inf for every nonzero value); other dtypes pass unchanged."""
    return x.float() if x.dtype == torch.float16 else x


def preserves_shape(block: nn.Module) -> bool:
    """A torchvision/smp BasicBlock or Bottleneck with no projection and stride 1."""
    if getattr(block, "downsample", None) is not None:
        return False
    convs = [m for m in block.modules() if isinstance(m, nn.Conv2d)]
    return bool(convs) and all(c.stride == (1, 1) for c in convs) \
        and convs[0].in_channels == convs[-1].out_channels


def convert_stage(stage: nn.Sequential, gamma: float,
                  memory_saving: bool) -> tuple[nn.Sequential, list[int]]:
    """Stage with every maximal run of shape-preserving blocks as MomentumBlocks; also returns
    the indices of the converted blocks."""
    parts: list[nn.Module] = []
    run: list[nn.Module] = []
    converted: list[int] = []
    for i, block in enumerate(stage):
        if preserves_shape(block):
            run.append(block)
            converted.append(i)
            continue
        if run:
            parts.append(MomentumBlocks(run, gamma, memory_saving))
            run = []
        parts.append(block)
    if run:
        parts.append(MomentumBlocks(run, gamma, memory_saving))
    return nn.Sequential(*parts), converted


def convert_residual_stages(model: nn.Module, gamma: float,
                            memory_saving: bool = True) -> dict[str, list[int]]:
    """Replace the model's residual stages in place; returns {stage: converted block indices}."""
    report = {}
    for name in model.residual_stage_names:
        new, converted = convert_stage(getattr(model.encoder, name), gamma, memory_saving)
        setattr(model.encoder, name, new)
        report[name] = converted
    return report


def check(opts: Options, plan: Plan) -> None:
    if not 0.0 < opts.gamma < 1.0:
        raise ConfigError(f"invertible: gamma={opts.gamma} must be in (0, 1): backward divides by "
                          "gamma to rebuild activations, and gamma=1 removes the blocks; use e.g. "
                          "invertible:0.9")


def apply(opts: Options, build: Build) -> None:
    model = build.model
    if not hasattr(model, "residual_stage_names"):
        raise ConfigError("invertible: the model exposes no residual_stages; drop invertible")
    report = convert_residual_stages(model, opts.gamma, opts.memory_saving)
    build.notes["invertible_blocks"] = {k: v for k, v in report.items()}


register(Technique("invertible", Stage.STRUCTURE, Options,
                   "MomentumNet encoder blocks: activations rebuilt in backward (extra forward)",
                   apply, check, order=10,
                   needs_unet="converts the encoder's shape-preserving residual blocks"))  # first: later structural techniques see its blocks
