"""Row geometry of a tiled region: which input rows an output row needs, halos, tile plans.

Tiles are row strips of the full width. All rows are counted on the region's *coarse grid*,
its lowest resolution (1/2**levels of the input): a tile owns coarse rows [a, b) and is computed
from the strip [q0, q1) = [a - halo_top, b + halo_bottom) clipped to the image. A tensor of the
region at `factor` times the coarse resolution then covers rows [factor*q0, factor*q1) of its own
grid, and owns [factor*a, factor*b): because strips start on coarse rows, every stride in the
region divides the strip's start, so a strided convolution of a strip computes exactly the
global rows it claims to (no half-row offsets).

The halo comes from the region's receptive field: for each path from an input to a tensor whose
owned rows matter (the output, and each BatchNorm's input), the rows an owned row reads are
propagated backwards op by op (`needed_rows`). Rows outside a strip that are not the image border
are zero-padded by the convolution of the strip and so wrong; the halo keeps them out of every
owned row. At the image border the strip reaches the border and the padding is the real one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Window:
    """A convolution or pooling along rows: output row i reads input rows
    [stride*i - pad, stride*i - pad + kernel)."""
    kernel: int
    stride: int = 1
    pad: int = 0

    def needs(self, lo: int, hi: int) -> tuple[int, int]:
        return self.stride * lo - self.pad, self.stride * (hi - 1) - self.pad + self.kernel


@dataclass(frozen=True)
class Upsample:
    """Nearest up-sampling by an integer factor: output row i reads input row i // factor."""
    factor: int = 2

    def needs(self, lo: int, hi: int) -> tuple[int, int]:
        return lo // self.factor, (hi - 1) // self.factor + 1


Op = Union[Window, Upsample]


@dataclass(frozen=True)
class Path:
    """From input `source` (at `source_factor` x the coarse grid) through `ops` to a tensor at
    `factor` x the coarse grid."""
    source_factor: int
    factor: int
    ops: tuple[Op, ...]


def needed_rows(ops: tuple[Op, ...], lo: int, hi: int) -> tuple[int, int]:
    """Input rows [lo', hi') that output rows [lo, hi) of `ops` (applied in order) read."""
    for op in reversed(ops):
        lo, hi = op.needs(lo, hi)
    return lo, hi


def halo(paths: list[Path]) -> tuple[int, int]:
    """(top, bottom) coarse rows a strip must extend beyond the rows its tile owns."""
    # a reference tile far from the border, on a start aligned to every stride in the paths
    a = 1 << 12
    top = bottom = 0
    for path in paths:
        lo, hi = needed_rows(path.ops, path.factor * a, path.factor * (a + 1))
        f = path.source_factor
        top = max(top, math.ceil((f * a - lo) / f))
        bottom = max(bottom, math.ceil((hi - f * (a + 1)) / f))
    return top, bottom


@dataclass(frozen=True)
class Tile:
    own: tuple[int, int]  # coarse rows whose results this tile writes
    strip: tuple[int, int]  # coarse rows it computes (owned rows plus halo, clipped)


def split_rows(total: int, tiles: int = 0, rows: int = 0) -> list[tuple[int, int]]:
    """Owned coarse-row ranges: `tiles` near-equal strips, or strips of `rows` (the last one
    shorter). Exactly one of tiles / rows is given."""
    if rows:
        return [(a, min(a + rows, total)) for a in range(0, total, rows)]
    if not 1 <= tiles <= total:
        raise ValueError(f"{tiles} tiles of {total} rows")
    bounds = [round(i * total / tiles) for i in range(tiles + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def plan_tiles(owned: list[tuple[int, int]], total: int, top: int, bottom: int) -> list[Tile]:
    return [Tile((a, b), (max(0, a - top), min(total, b + bottom))) for a, b in owned]
