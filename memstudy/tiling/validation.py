"""Exact tiled validation: the eval forward with the top levels run in row strips.

In eval mode BatchNorm normalises with its running statistics, so a tile needs no statistics
sweep: one sweep per region, under `torch.no_grad` and the run's autocast, and the output equals
the untiled forward to float rounding (tests/test_tiling.py). The full- and half-resolution
levels, which set the validation peak at large sizes, then hold one strip at a time; the
levels below run untiled. `rows` = 0 runs the untiled forward (for comparison).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from memstudy.tiling.levels import STREAM_VALIDATION_LEVELS, VALIDATION_LEVELS
from memstudy.tiling.tiled_forward import TiledForward, plain_stages


# A technique whose per-block forward wrappers the tiled walk would bypass (it calls the
# blocks' layers itself) sets this attribute on the U-Net to the reason: validation then runs
# untiled and records that reason (tri_accel:precision's per-unit autocast, fsdp's per-block
# parameter gathering).
UNTILED_REASON = "untiled_validation_reason"


def find_unet(model: nn.Module) -> nn.Module | None:
    """The UNet inside DDP / torch.compile wrappers, or None (a split model)."""
    seen = 0
    while model is not None and seen < 4:
        if hasattr(model, "forward_padded") and hasattr(model, "decoder_blocks"):
            return model
        model = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        seen += 1
    return None


def validation_levels(unet: nn.Module) -> int:
    """VALIDATION_LEVELS, or 2 where layer1 is not what levels=3 tiles (invertible's momentum
    blocks): exact either way, the 1/4-res level then runs untiled."""
    return VALIDATION_LEVELS if plain_stages(unet, VALIDATION_LEVELS) else 2


def streamed_levels(unet: nn.Module) -> int:
    """The levels a validation batch in host memory (tile:stream) is tiled over: down to 1/8
    res where the encoder's stages are the walks' (4), so that the untiled levels' input is
    layer2's output, as in a streamed training step at the largest sizes."""
    return STREAM_VALIDATION_LEVELS if plain_stages(unet, STREAM_VALIDATION_LEVELS) else \
        validation_levels(unet)


@contextlib.contextmanager
def forward_padded_as(unet: nn.Module, rows: int, levels: int = VALIDATION_LEVELS,
                      stream: bool = False):
    """Within: `unet`'s forward_padded is the tiled one over `levels` (rows > 0; `stream`: its
    boundaries in host memory) or the untiled one (0)."""
    had = "forward_padded" in vars(unet)
    previous = vars(unet).get("forward_padded")
    # keep="none": in eval mode there are no statistics sweeps to save, only boundaries to hold
    unet.forward_padded = (TiledForward(unet, levels, rows=rows, keep="none", stream=stream)
                           if rows else type(unet).forward_padded.__get__(unet))
    try:
        yield
    finally:
        if had:
            unet.forward_padded = previous
        else:
            del unet.forward_padded


def validation_forward(model: nn.Module, x: torch.Tensor, rows: int) -> tuple[torch.Tensor, str]:
    """The eval-mode output for `x`, and how it was computed (recorded with the run)."""
    unet = find_unet(model)
    if unet is None:
        return model(x), ("untiled (the model is not the whole U-Net: split across devices or "
                          "stages, or a model.factory network)")
    device = next(unet.parameters()).device
    streamed = x.device != device  # a batch kept in host memory (tile:stream)
    levels = streamed_levels(unet) if streamed else validation_levels(unet)
    reason = getattr(unet, UNTILED_REASON, None) if rows else None
    rows = 0 if reason else rows
    if not rows:  # the untiled forward reads the batch whole on the device
        x = x.to(device, non_blocking=True)
    with forward_padded_as(unet, rows, levels, stream=streamed):
        out = unet(x)  # wrappers bypassed: an eval forward needs no DDP sync nor compilation
    untiled = f"untiled ({reason or 'val_tile_rows=0'})"
    host = ", boundaries in host memory" if streamed else ""
    how = f"tiled: levels={levels}, rows={rows}{host}" if rows else untiled
    return out, how
