"""Which levels the tiled regions of the U-Net cover, and their halos (pure Python: the config
checks use it without importing torch).

`levels` counts the resolution levels tiled, from full resolution down; `keep` chooses the kept
boundaries between regions (memstudy/tiling/chain.py lays the regions out; tiled_forward.py runs them).
The halos follow from the regions' own walks (chain.trace).
"""
from __future__ import annotations

from memstudy.errors import ConfigError
from memstudy.network import ENCODERS, DEFAULT_ENCODER
from memstudy.tiling.chain import LAYER1, Stages, region_specs, trace
from memstudy.tiling.geometry import halo

LEVELS = (1, 2, 3, 4)  # tiled levels implemented
# kept boundaries besides the regions' inputs and output: the first convolution output (before
# its BatchNorm) of no decoder block, of those with a skip, or of every tiled decoder block; or
# every BatchNorm's input (the stem's convolution output and both of each block's convolutions);
# or every one but the full-resolution block's second convolution output (chain._cuts)
KEEP = ("none", "conv1", "all", "half", "bn")
# tile:plans, the plan sets tile:auto picks among (memstudy/tiling/auto.py, PLAN_SETS), the
# latest last: the default with auto
AUTO_PLAN_SETS = (1, 2)
VALIDATION_LEVELS = 3  # what the tiled validation forward tiles (1/4 res included: 8192 px)
STREAM_VALIDATION_LEVELS = 4  # ... of a batch in host memory (tile:stream: 16384 px)
NETWORK_LEVELS = 6  # full resolution and the five down-sampled grids (1/2 .. 1/32)


def halos(levels: int, keep: str = "none", layer1: str = "whole",
          encoder: str = DEFAULT_ENCODER) -> dict[str, tuple[int, int]]:
    """(top, bottom) halo in coarse rows of each region tiled at `levels` with `keep`, for the
    U-Net of `encoder` (its residual stages' blocks set the halo at levels 3 and 4)."""
    stages = Stages.of(ENCODERS[encoder])
    return {spec.name: halo(trace(spec, levels).paths)
            for spec in region_specs(levels, keep, layer1, stages)}


def min_tile_rows(levels: int, keep: str = "none", layer1: str = "whole",
                  encoder: str = DEFAULT_ENCODER) -> int:
    """Full-resolution rows of the widest halo: a tile must own at least this many rows."""
    return max(max(h) for h in halos(levels, keep, layer1, encoder).values()) * 2 ** levels


def check_levels(levels: int, what: str) -> None:
    if not 1 <= levels <= NETWORK_LEVELS:
        raise ConfigError(f"{what}={levels}: the U-Net has {NETWORK_LEVELS} resolution levels "
                          f"(full, 1/2 .. 1/32); tiled levels are counted from full resolution: "
                          f"use one of {list(LEVELS)}")
    if levels not in LEVELS:
        raise ConfigError(f"{what}={levels} is not implemented (tiling 1/16 res and below would "
                          f"tile layer3, whose tensors are 1/256 of the image's pixels: never "
                          f"the memory floor); use one of {list(LEVELS)}")


def check_layer1(layer1: str, levels: int, what: str) -> None:
    if layer1 not in LAYER1:
        raise ConfigError(f"{what}={layer1!r} is not a way to cut layer1; use one of {list(LAYER1)}")
    if layer1 != "whole" and levels < 3:
        raise ConfigError(f"{what}={layer1} cuts layer1, which only levels 3 and 4 tile (levels="
                          f"{levels}); set tile:levels=3 or {what}=whole")


def check_keep(keep: str, what: str) -> None:
    if keep not in KEEP:
        raise ConfigError(f"{what}={keep!r} is not a kept-boundary choice; use one of {list(KEEP)}")
