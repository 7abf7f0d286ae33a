"""Which levels the tiled regions of the U-Net cover, and their halos (pure Python: the config
checks use it without importing torch).

`levels` counts the resolution levels tiled, from full resolution down (memstudy/tiling/unet.py
describes the regions). The receptive-field paths below follow the regions' bodies op by op.
"""
from __future__ import annotations

from memstudy.errors import ConfigError
from memstudy.tiling.geometry import Path, Upsample, Window, halo

LEVELS = (1, 2)  # tiled levels implemented
VALIDATION_LEVELS = 2  # what the tiled validation forward tiles
NETWORK_LEVELS = 6  # full resolution and the five down-sampled grids (1/2 .. 1/32)
STEM = Window(7, 2, 3)
POOL = Window(3, 2, 1)
CONV3 = Window(3, 1, 1)
UP = Upsample(2)


def top_paths(levels: int) -> list[Path]:
    """Receptive-field paths of region "top": to each BatchNorm input and to the output."""
    if levels == 1:  # input d3 (1/2 res) is the coarse grid, the output is at factor 2
        chain = [UP, CONV3, CONV3, CONV3]  # block4 conv1, conv2, head
        return [Path(1, 2, tuple(chain[:i])) for i in (2, 3, 4)]
    # input d2 at factor 1 and x at factor 4; block3 at factor 2, block4 and head at 4
    low = [UP, CONV3, CONV3, UP, CONV3, CONV3, CONV3]
    high = [STEM, CONV3, CONV3, UP, CONV3, CONV3, CONV3]
    factors = [2, 2, 4, 4, 4]  # z of block3.conv1, block3.conv2, block4.conv1/2, head out
    ends = [2, 3, 5, 6, 7]
    paths = [Path(4, 2, (STEM,))]  # bn1's input
    for factor, end in zip(factors, ends):
        paths += [Path(1, factor, tuple(low[:end])), Path(4, factor, tuple(high[:end]))]
    return paths


def stem_paths() -> list[Path]:
    return [Path(4, 2, (STEM,)), Path(4, 1, (STEM, POOL))]


def halos(levels: int) -> dict[str, tuple[int, int]]:
    """(top, bottom) halo in coarse rows of each region tiled at `levels`."""
    found = {"top": halo(top_paths(levels))}
    if levels >= 2:
        found["stem"] = halo(stem_paths())
    return found


def min_tile_rows(levels: int) -> int:
    """Full-resolution rows of the widest halo: a tile must own at least this many rows."""
    return max(max(h) for h in halos(levels).values()) * 2 ** levels


def check_levels(levels: int, what: str) -> None:
    if not 1 <= levels <= NETWORK_LEVELS:
        raise ConfigError(f"{what}={levels}: the U-Net has {NETWORK_LEVELS} resolution levels "
                          f"(full, 1/2 .. 1/32); tiled levels are counted from full resolution: "
                          f"use one of {list(LEVELS)}")
    if levels not in LEVELS:
        raise ConfigError(f"{what}={levels} is not implemented (tiling 1/4 res and below would "
                          f"recompute layer1's skip feature per tile); use one of {list(LEVELS)}")
