"""Every layer's gradient mean and variance from one flat buffer: a Triton kernel and its reference.

Tri-Accel's precision controller needs Var[grad_l] for each layer l at each step. A Python
loop of `torch.var_mean` calls costs one or two kernel launches per layer (and a sync-free but
serial chain of tiny reductions); here the gradients are laid end to end in one flat buffer
whose layer boundaries are given by an offsets array, and the statistics of all layers come
from two launches whatever the number of layers:

1. `_tile_stats`: the buffer is cut into tiles that never straddle a layer boundary; each
   program reduces one tile to (count, mean, M2) with a two-pass method in float32 (mean
   first, then the sum of squared deviations), so no catastrophic cancellation of E[x^2]-E[x]^2.
2. `_combine`: one program per layer merges its tiles with Chan et al.'s pairwise formula,
   M2 = sum(M2_i + n_i (mean_i - mean)^2), again in two passes.

Variance is the population variance (M2 / n), in float32. `segment_stats_reference` is the
plain PyTorch definition the kernel is tested against (TRITON_INTERPRET=1 runs it on the CPU)
and benchmarked against (benchmarks/bench_kernels.py). Triton is imported lazily, and the
kernels are built per value of TRITON_INTERPRET, because triton decides at decoration time
whether a function is interpreted.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from memstudy.kernels import interpreted

TILE = 16384  # elements per tile: large enough to amortise a program, small enough to spread load
BLOCK = 1024  # elements per vector step inside a program


@dataclass(frozen=True)
class SegmentLayout:
    """Where each layer lies in the flat buffer, and the tiles that cover it."""
    offsets: torch.Tensor  # int64 [n_segments + 1]: segment s is flat[offsets[s]:offsets[s+1]]
    tile_start: torch.Tensor  # int64 [n_tiles]
    tile_len: torch.Tensor  # int32 [n_tiles]
    seg_tiles: torch.Tensor  # int64 [n_segments + 1]: tiles of segment s are seg_tiles[s]:seg_tiles[s+1]

    @property
    def n_segments(self) -> int:
        return self.offsets.numel() - 1

    @property
    def n_tiles(self) -> int:
        return self.tile_start.numel()


def make_layout(sizes: Sequence[int], device: torch.device | str = "cpu",
                tile: int = TILE) -> SegmentLayout:
    """Layout for segments of the given sizes (each >= 1), tiles of at most `tile` elements."""
    if any(n < 1 for n in sizes):
        raise ValueError(f"every segment needs at least one element (sizes {list(sizes)})")
    offsets, starts, lens, seg_tiles, pos = [0], [], [], [0], 0
    for n in sizes:
        for t in range(0, n, tile):
            starts.append(pos + t)
            lens.append(min(tile, n - t))
        pos += n
        offsets.append(pos)
        seg_tiles.append(len(starts))
    as_tensor = functools.partial(torch.tensor, device=device)
    return SegmentLayout(as_tensor(offsets, dtype=torch.int64), as_tensor(starts, dtype=torch.int64),
                         as_tensor(lens, dtype=torch.int32), as_tensor(seg_tiles, dtype=torch.int64))


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors end to end in one contiguous buffer (one copy, one launch)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def segment_stats_reference(flat: torch.Tensor, offsets: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, population variance) of each segment in float32: one `var_mean` per segment."""
    bounds = [int(o) for o in offsets]
    pairs = [torch.var_mean(flat[a:b].float(), correction=0) for a, b in zip(bounds, bounds[1:])]
    var = torch.stack([v for v, _ in pairs])
    mean = torch.stack([m for _, m in pairs])
    return mean, var


def segment_stats(flat: torch.Tensor, layout: SegmentLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, population variance) of each segment, float32, computed by the Triton kernels.

    Runs on a CUDA tensor, or on a CPU tensor under TRITON_INTERPRET=1 (tests)."""
    interpret = interpreted()
    if flat.device.type != "cuda" and not interpret:
        raise ValueError("segment_stats runs the Triton kernel: pass a CUDA tensor, set "
                         "TRITON_INTERPRET=1, or call segment_stats_reference")
    tile_stats, combine = _kernels(interpret)
    n_tiles, n_segments = layout.n_tiles, layout.n_segments
    part = torch.empty(3, n_tiles, dtype=torch.float32, device=flat.device)
    out = torch.empty(2, n_segments, dtype=torch.float32, device=flat.device)
    tile_stats[(n_tiles,)](flat, layout.tile_start, layout.tile_len, part[0], part[1], part[2],
                           TILE=TILE, BLOCK=BLOCK)
    combine[(n_segments,)](layout.seg_tiles, part[0], part[1], part[2], out[0], out[1], BLOCK=256)
    return out[0], out[1]


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """Build the two kernels (interpreted or compiled, as TRITON_INTERPRET says now)."""
    del interpret  # part of the cache key only: triton reads the variable itself at decoration
    import triton
    import triton.language as tl

    @triton.jit
    def tile_stats(x_ptr, start_ptr, len_ptr, n_ptr, mean_ptr, m2_ptr,
                   TILE: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        start = tl.load(start_ptr + pid)
        n = tl.load(len_ptr + pid)
        lanes = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for off in tl.range(0, TILE, BLOCK):  # pass 1: the tile's mean
            mask = off + lanes < n
            acc += tl.load(x_ptr + start + off + lanes, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / n.to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for off in tl.range(0, TILE, BLOCK):  # pass 2: squared deviations from it (tile is in L2)
            mask = off + lanes < n
            x = tl.load(x_ptr + start + off + lanes, mask=mask, other=0.0).to(tl.float32)
            d = tl.where(mask, x - mean, 0.0)
            acc += d * d
        tl.store(n_ptr + pid, n.to(tl.float32))
        tl.store(mean_ptr + pid, mean)
        tl.store(m2_ptr + pid, tl.sum(acc, axis=0))

    @triton.jit
    def combine(seg_tiles_ptr, n_ptr, mean_ptr, m2_ptr, out_mean_ptr, out_var_ptr,
                BLOCK: tl.constexpr):
        seg = tl.program_id(0)
        first = tl.load(seg_tiles_ptr + seg)
        last = tl.load(seg_tiles_ptr + seg + 1)
        lanes = tl.arange(0, BLOCK)
        count = tl.zeros([BLOCK], dtype=tl.float32)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for t in range(first, last, BLOCK):  # pass 1: the segment's count and mean
            mask = t + lanes < last
            n = tl.load(n_ptr + t + lanes, mask=mask, other=0.0)
            count += n
            total += n * tl.load(mean_ptr + t + lanes, mask=mask, other=0.0)
        big_n = tl.sum(count, axis=0)
        mean = tl.sum(total, axis=0) / big_n
        m2 = tl.zeros([BLOCK], dtype=tl.float32)
        for t in range(first, last, BLOCK):  # pass 2: Chan's merge of the tiles' M2
            mask = t + lanes < last
            n = tl.load(n_ptr + t + lanes, mask=mask, other=0.0)
            d = tl.load(mean_ptr + t + lanes, mask=mask, other=0.0) - mean
            m2 += tl.load(m2_ptr + t + lanes, mask=mask, other=0.0) + n * d * d
        tl.store(out_mean_ptr + seg, mean)
        tl.store(out_var_ptr + seg, tl.sum(m2, axis=0) / big_n)

    return tile_stats, combine
