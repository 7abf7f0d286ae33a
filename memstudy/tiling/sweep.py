"""Exact tile-by-tile forward and backward of a region with BatchNorm in training mode.

A `Region` is a function of a few full-size inputs (its boundaries) written for one tile
(`body(run, *strips)`); every BatchNorm inside it is called through `run.norm(j, z)`, which
normalises with explicit statistics instead of the tile's own. The statistics of BatchNorm k
are those of its input z_k over the *whole image*, produced by `_Stats` (a sweep over tiles that
runs the body up to z_k and merges the owned rows), and they are ordinary differentiable
tensors: `_Apply` (a sweep that writes the owned output rows) takes them as inputs, so autograd
hands their gradients back to the `_Stats` that made them.

Backward of either Function recomputes each tile with grad enabled (nothing of a tile is kept
between forward and backward) and backpropagates the owned rows only:
- `_Apply`: the surrogate sum_owned(out * grad_out);
- `_Stats` k: mean_k = sum(z)/N and var_k = sum((z - mean_k)^2)/N, so dL/dz = g_mean/N +
  g_var * 2 (z - mean_k) / N (the path through mean_k in var_k vanishes: sum(z - mean_k) = 0).
Each yields gradients for the input strips (added into one full-size gradient per input that
all the region's Functions share: `Sweep`), for the earlier statistics and for the parameters.
With K BatchNorms computed in a region, a training step runs K + 1 forward sweeps and K + 1
backward sweeps of that region, and nothing of full size other than the region's inputs, their
gradients and the output is alive at any time. A `_Stats` sweep, forward and backward, reads
only the inputs the body has used by the time it reaches its BatchNorm's input
(`Region.reads`, from chain.trace): a residual block's identity or a decoder block's skip,
used after it, is not copied in there (tile:stream), and gets no gradient from it anyway.

A region whose output is the input of a BatchNorm (`Region.out_norm`: it stops at a kept
tensor before a BatchNorm) also returns that BatchNorm's statistics from `_Apply`: the moments
of the owned output rows, merged in the same sweep that writes them. The next region takes them
as given statistics instead of running a sweep that only re-reads its input, and `_Apply`'s
backward adds their gradient (the `_Stats` formula on the recomputed output) to grad_out's rows.

Streaming (`host=True`, tile:stream): the region's output is assembled in host memory
(pinned on CUDA) instead of on the device, its input strips come from wherever the inputs lie
(a host boundary's strip is copied in as its tile starts, or with `ahead` while the tile
before computes), and a host
input's gradient adds up on the host, a strip's rows at a time. The sweeps compute on
`Sweep.device` either way, and the same rows are added in the same order, so the values are the
device path's to the bit. What the device then holds of a region is one strip's working set;
the copies run on the compute stream, which orders them with the kernels, or with `ahead`
(tile:ahead=true) on side streams (one each way), a tile ahead, ordered with the kernels by
events (memstudy/streaming.py), the next strip's inputs then on the device too; every sweep
ends with the compute stream waiting for its copies.

Numerics: tile statistics are merged with Chan's parallel formula in float32 (float64 for a
float64 model); normalisation (fused with the ReLU after it: memstudy/tiling/norm.py) runs in
that precision from the explicit statistics and casts back to the convolution's dtype, as
cuDNN's BatchNorm does under autocast. The backward re-enters
the forward's autocast state. Running statistics are updated once per step, here, with
PyTorch's formula (momentum, unbiased variance, num_batches_tracked); a BatchNorm in eval mode
uses its running statistics and gets no `_Stats` at all (the exact tiled inference path).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from memstudy.runtime import ROWS_IN, mark_boundary
from memstudy.streaming import Fetched, add_rows, fetch, host_empty, settle, write_rows
from memstudy.tiling.geometry import Path, Tile
from memstudy.models.unet import memory_format_of
from memstudy.tiling.norm import Stats, moments, normalize, statistics_seed

@dataclass
class Region:
    name: str
    input_factors: tuple[int, ...]  # each input's resolution in multiples of the coarse grid
    norms: list[nn.modules.batchnorm._BatchNorm]  # every BatchNorm the body calls, in order
    shared: int  # norms[:shared] take statistics computed by an earlier region
    modules: list[nn.Module]  # whose parameters the body uses
    paths: list[Path]  # receptive-field paths (geometry.halo)
    body: Callable[..., torch.Tensor]  # body(run, *strips) -> output strip
    norm_names: list[str] = field(default_factory=list)  # the norms' names (chain.py), in order
    out_norm: nn.modules.batchnorm._BatchNorm | None = None  # normalises the output, if any
    kernels: str = "triton"  # the BatchNorms' kernels on CUDA strips (norm.py; tile:norm)
    # per norm: which inputs the body has used when it reaches that norm's input, all that a
    # statistics sweep of it reads (chain.trace); empty: every input, for every sweep
    reads: list[tuple[bool, ...]] = field(default_factory=list)

    def inputs_read(self, target: int | None) -> tuple[bool, ...] | None:
        """The inputs a sweep for the statistics of norm `target` reads (None: an apply
        sweep, or no record: all of them). A statistics sweep stops at its norm's input, so an
        input used only after it (a residual block's identity, a decoder block's skip) is
        neither copied in nor given a gradient there."""
        if target is None or not self.reads:
            return None
        return self.reads[target]

    def params(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for module in self.modules:
            for p in module.parameters():
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())


class _Reached(Exception):
    """Stops a tile's body at the BatchNorm whose input a statistics sweep wants."""

    def __init__(self, z: torch.Tensor):
        super().__init__()
        self.z = z


class TileRun:
    """One tile's run of a region body: crops owned rows and normalises with given statistics."""

    def __init__(self, region: Region, tile: Tile, stats: Sequence[Stats | None],
                 target: int | None = None):
        self.region, self.tile, self.stats, self.target = region, tile, stats, target

    def owned(self, t: torch.Tensor) -> torch.Tensor:
        lo, hi = self.owned_span(t)
        return t[..., lo:hi, :]

    def owned_span(self, t: torch.Tensor) -> tuple[int, int]:
        """The rows of strip-sized `t` that the tile owns, as (first, end)."""
        (a, b), (q0, q1) = self.tile.own, self.tile.strip
        factor = t.shape[-2] // (q1 - q0)
        return factor * (a - q0), factor * (b - q0)

    def norm(self, j: int, z: torch.Tensor, relu: bool = False) -> torch.Tensor:
        if j == self.target:
            raise _Reached(z)
        return normalize(z, self.stats[j], self.region.norms[j], relu, self.region.kernels)

    def __call__(self, strips: list[torch.Tensor]) -> torch.Tensor:
        """The owned rows of the tile's output (or of the target BatchNorm's input)."""
        return self.owned(self.uncropped(strips))

    def uncropped(self, strips: list[torch.Tensor]) -> torch.Tensor:
        """The same over the whole strip, halo rows included."""
        try:
            return self.region.body(self, *strips)
        except _Reached as reached:
            return reached.z


def strips_of(region: Region, tile: Tile, inputs: Sequence[torch.Tensor],
              device: torch.device | None = None) -> list[torch.Tensor]:
    """The tile's rows of each input on `device` (default: where each input lies): a host
    input's strip is copied in (tile:stream); an input offload brings back by rows may still
    be arriving (runtime.RowArrivals)."""
    return [f.get() for f in fetch_strips(region, tile, inputs, device)]


def fetch_strips(region: Region, tile: Tile, inputs: Sequence[torch.Tensor],
                 device: torch.device | None, side: bool = True,
                 reads: Sequence[bool] | None = None) -> list[Fetched]:
    """strips_of, started: a host input's strip is on its way (streaming.fetch; `side`: on the
    side stream); a device input's is sliced when asked for, after its rows have arrived; an
    input the sweep does not read (`reads`, Region.inputs_read) comes as None."""
    q0, q1 = tile.strip
    return [_fetch_rows(x, f * q0, f * q1, device, side) if reads is None or reads[i]
            else Fetched(pending=lambda: None)
            for i, (x, f) in enumerate(zip(inputs, region.input_factors))]


def _fetch_rows(x: torch.Tensor, lo: int, hi: int, device: torch.device | None,
                side: bool) -> Fetched:
    if x.device.type == "cpu" and device is not None and device.type == "cuda" and side:
        return fetch(x[..., lo:hi, :], device, side=True)

    def arrived() -> torch.Tensor:
        ROWS_IN.await_rows(x, lo, hi)
        return fetch(x[..., lo:hi, :], device, side).get()
    return Fetched(pending=arrived)


def tile_strips(sweep: "Sweep", inputs: Sequence[torch.Tensor],
                tiles: Sequence[Tile] | None = None, seed: "Seed | None" = None,
                target: int | None = None):
    """(tile, its strips, its rows of seed's grad_out or None) for each of `tiles` (default:
    the sweep's) in order; `target`: the norm a statistics sweep stops at (the inputs it does
    not read come as None). With `sweep.ahead` the next tile's fetches start as a tile is
    handed out, so a host boundary's strips are copied in while the caller computes the tile
    before (tile:stream); without, each tile's as it is handed out, on the compute stream."""
    tiles = list(sweep.tiles if tiles is None else tiles)
    reads = sweep.region.inputs_read(target)

    def started(tile: Tile) -> list[Fetched]:
        rows = [] if seed is None else [seed.fetch_rows(tile, sweep)]
        return fetch_strips(sweep.region, tile, inputs, sweep.device, sweep.ahead,
                            reads) + rows

    coming = started(tiles[0]) if tiles else []
    for i, tile in enumerate(tiles):
        got = [f.get() for f in (coming if sweep.ahead or i == 0 else started(tile))]
        if i + 1 < len(tiles) and sweep.ahead:
            coming = started(tiles[i + 1])
        if seed is None:
            yield tile, got, None
        else:
            yield tile, got[:-1], got[-1]


# -- the two sweeps as autograd Functions ------------------------------------------------------
@dataclass
class Sweep:
    """What both Functions need besides tensors: region, tiles, the forward's autocast state,
    and the region's input gradients, shared by all its Functions.

    Every Function of a region (K `_Stats` and one `_Apply`) backpropagates into the same
    full-size inputs. Returning one full-size gradient each would keep two of them alive while
    autograd sums them (at full resolution, 16 channels of 4192 x 4192 (4188 padded) in bf16:
    562 MB more at the backward's peak), so they add into one buffer per input instead, and
    the Function whose backward runs last returns it (the others return None for that
    input)."""
    region: Region
    tiles: list[Tile]
    autocast: tuple[str, bool, torch.dtype]
    recording: bool = False  # the forward ran with grad enabled: backward will follow
    graphs: Any = None  # memstudy.tiling.graphs.TileGraphs: tile bodies replayed as CUDA graphs
    out_stats: bool = False  # _Apply also returns the statistics of its output (out_norm's)
    device: torch.device | None = None  # where the tiles compute (None: where the inputs lie)
    host: bool = False  # the output is assembled in host memory (tile:stream)
    ahead: bool = False  # host copies on side streams, the next tile's started early (tile:ahead)
    input_grads: list = field(init=False)  # per input: the shared buffer, or None
    pending: list = field(init=False)  # per input: Functions yet to add into it
    # per input: the first row of a host buffer that nothing has written yet (None: the buffer
    # was zero-filled). A host buffer is written as the first backward sweep's tiles come, top to
    # bottom, instead of being zero-filled and then read back to be added to (add_input_grad)
    unwritten: list = field(init=False)
    # The region's inputs are saved once, by _Apply, whose backward runs first (every _Stats
    # output feeds it): its unpacked inputs serve the _Stats backwards after it, so a
    # transform such as offload brings each input back once per backward, not once per
    # Function (with two inputs, a held copy of one was evicted by the other: at 8192 px each
    # layer1 input crossed PCIe twice).
    restored: list | None = field(init=False, default=None)
    stats_sweeps: int = field(init=False, default=0)  # _Stats Functions recorded
    stats_left: int = field(init=False, default=0)  # ... whose backward is still to come

    def __post_init__(self) -> None:
        self.input_grads, self.pending = [None] * self.n_inputs, [0] * self.n_inputs
        self.unwritten = [None] * self.n_inputs

    def share_inputs(self, inputs: list) -> None:
        """_Apply's backward: its unpacked inputs, for the _Stats backwards to come."""
        if self.stats_sweeps:
            self.restored, self.stats_left = inputs, self.stats_sweeps

    def shared_inputs(self) -> list:
        """A _Stats backward: the inputs _Apply's backward unpacked; the last one lets go."""
        inputs = self.restored
        if inputs is None:
            raise RuntimeError("tile: a statistics sweep's backward ran before its region's "
                               "apply backward, which unpacks the region's inputs")
        self.stats_left -= 1
        if self.stats_left <= 0:
            self.restored = None
        return inputs

    def expect(self, needs: Sequence[bool]) -> None:
        """A Function was recorded whose backward will add into the inputs it `needs`."""
        if self.recording:
            for i in range(self.n_inputs):
                self.pending[i] += bool(needs[i])

    def input_grad(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """The shared gradient of input i, where the input lies (a host input's on the host,
        unwritten until add_input_grad writes it; CUDA graphs add into a zero-filled one)."""
        if self.input_grads[i] is None:
            if like.device.type == "cpu" and self.graphs is None:
                self.input_grads[i] = host_empty(like.shape, like.dtype, self.device,
                                                 memory_format_of(like))
                self.unwritten[i] = 0
            else:
                self.input_grads[i] = torch.zeros_like(like)
        return self.input_grads[i]

    def add_input_grad(self, i: int, like: torch.Tensor, lo: int, hi: int,
                       part: torch.Tensor) -> None:
        """Rows lo:hi of input i's shared gradient += part. Rows nothing has written yet are
        written, not added to (0 + g is g): on the host no zero fill, and no copy in of zeros.
        The first sweep's tiles come top to bottom and each strip starts at or above the last
        one's end, so the rows below `unwritten` are the only ones written so far."""
        full, start = self.input_grad(i, like), self.unwritten[i]
        if start is None or hi <= start:
            add_rows(full, lo, hi, part, self.ahead)
            return
        if lo > start:  # rows no strip's gradient reached (a tile that did not need it)
            full[..., start:lo, :].zero_()
        cut = max(lo, start)
        if cut > lo:  # the rows the strip before wrote (its halo), added to
            add_rows(full, lo, cut, part[..., :cut - lo, :], self.ahead)
        write_rows(full[..., cut:hi, :], part[..., cut - lo:, :], self.ahead)
        self.unwritten[i] = hi

    def settle(self, i: int) -> torch.Tensor | None:
        """One Function's backward is done with input i: the sum once it was the last (rows no
        strip's gradient reached zeroed)."""
        self.pending[i] -= 1
        if self.pending[i]:
            return None
        grad, self.input_grads[i] = self.input_grads[i], None
        start, self.unwritten[i] = self.unwritten[i], None
        if start is not None and start < grad.shape[-2]:
            grad[..., start:, :].zero_()
        return grad

    @property
    def n_inputs(self) -> int:
        return len(self.region.input_factors)

    @property
    def n_tensors(self) -> int:
        """Inputs and flat statistics: the Functions' tensor arguments before the parameters."""
        return self.n_inputs + 2 * len(self.region.norms)

    def unpack(self, tensors: Sequence) -> tuple[list, list[Stats | None], list]:
        n, m = self.n_inputs, 2 * len(self.region.norms)
        flat = tensors[n:n + m]
        stats = [None if flat[i] is None else (flat[i], flat[i + 1]) for i in range(0, m, 2)]
        return list(tensors[:n]), stats, list(tensors[n + m:])


def detached(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A forward sweep's inputs without autograd history. A view taken in no-grad mode of a
    tensor that requires grad still says requires_grad (with no grad_fn), and hooks that
    trust the flag (torch.utils.flop_counter's module tracker, on a body that starts with a
    convolution of its input strip) then fail."""
    return [t.detach() for t in inputs]


def flatten_stats(stats: Sequence[Stats | None]) -> list[torch.Tensor | None]:
    return [t for s in stats for t in (s if s is not None else (None, None))]


def merge(acc: tuple[float, torch.Tensor, torch.Tensor] | None,
          tile_moments: tuple[int, torch.Tensor, torch.Tensor]):
    """Chan et al.'s parallel update of (count, mean, M2) with one tile's (count, mean, var)."""
    n, mean, var = tile_moments
    if acc is None:
        return n, mean, var * n
    n0, mean0, m2 = acc
    delta = mean - mean0
    total = n0 + n
    return total, mean0 + delta * (n / total), m2 + var * n + delta.square() * (n0 * n / total)


class _Stats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sweep: Sweep, k: int, counts: dict, *tensors):
        inputs, stats, _ = sweep.unpack(tensors)
        inputs = detached(inputs)
        acc = None
        if sweep.graphs is not None:
            for tile in sweep.tiles:
                acc = merge(acc, sweep.graphs.moments(sweep, tile, inputs, stats, k))
        else:
            for tile, strips, _ in tile_strips(sweep, inputs, target=k):
                acc = merge(acc, moments(TileRun(sweep.region, tile, stats, target=k)(strips),
                                         sweep.region.kernels))
            settle(sweep.device)
        count, mean, m2 = acc
        counts[k] = count
        var = m2 / count
        ctx.sweep, ctx.k, ctx.count = sweep, k, count
        sweep.expect(ctx.needs_input_grad[3:])
        sweep.stats_sweeps += sweep.recording
        # statistics go through saved-tensor hooks; the inputs are _Apply's to save (Sweep.
        # restored); parameters are alive anyway and are read from the modules
        ctx.save_for_backward(*tensors[sweep.n_inputs:sweep.n_tensors], mean)
        return mean, var

    @staticmethod
    def backward(ctx, g_mean, g_var):
        *stats, mean = ctx.saved_tensors
        sweep, count = ctx.sweep, ctx.count
        region = sweep.region

        seed = Seed(None, statistics_affine(mean, g_mean, g_var, count))
        tensors = sweep.shared_inputs() + list(stats) + region.params()
        grads = backprop_tiles(sweep, tensors, ctx.needs_input_grad[3:], ctx.k, seed)
        return (None, None, None, *grads)


class _Apply(torch.autograd.Function):
    """The region's output over the whole image (and, with `sweep.out_stats`, the mean and
    biased variance of it per channel, merged from the owned rows as they are written)."""

    @staticmethod
    def forward(ctx, sweep: Sweep, counts: dict, *tensors):
        inputs, stats, _ = sweep.unpack(tensors)
        inputs = detached(inputs)
        out, acc = None, None
        for tile, part in _applied_tiles(sweep, inputs, stats):
            if out is None:
                out = _full_like(part, inputs, sweep)
            factor = part.shape[-2] // (tile.own[1] - tile.own[0])
            write_rows(out[..., factor * tile.own[0]:factor * tile.own[1], :], part,
                       sweep.ahead)
            if sweep.out_stats:
                acc = merge(acc, moments(part, sweep.region.kernels))
        settle(sweep.device)  # a host output's last rows are written before anything reads it
        ctx.sweep = sweep
        sweep.expect(ctx.needs_input_grad[2:])
        # the region's inputs, for the _Stats backwards too (Sweep.restored); the statistics
        if not sweep.out_stats:
            ctx.save_for_backward(*tensors[:sweep.n_tensors])
            return out
        count, mean, m2 = acc
        counts["out"] = ctx.count = count
        ctx.save_for_backward(*tensors[:sweep.n_tensors], mean)
        return out, mean, m2 / count

    @staticmethod
    def backward(ctx, grad_out, g_mean=None, g_var=None):
        sweep = ctx.sweep
        with ROWS_IN.by_rows():  # the tiles wait for their strips' rows (strips_of)
            saved = list(ctx.saved_tensors)
        sweep.share_inputs(saved[:sweep.n_inputs])
        affine = None
        if sweep.out_stats:
            affine = statistics_affine(saved.pop(), g_mean, g_var, ctx.count)
        grads = backprop_tiles(sweep, saved + sweep.region.params(), ctx.needs_input_grad[2:],
                               None, Seed(grad_out, affine))
        return (None, None, *grads)


def _applied_tiles(sweep: Sweep, inputs: list, stats: list):
    """(tile, its owned output rows) for each tile of an _Apply sweep, graphed or eager."""
    if sweep.graphs is not None:
        for tile in sweep.tiles:
            yield tile, sweep.graphs.output(sweep, tile, inputs, stats)
        return
    for tile, strips, _ in tile_strips(sweep, inputs):
        yield tile, TileRun(sweep.region, tile, stats)(strips)


def statistics_affine(mean: torch.Tensor, g_mean: torch.Tensor, g_var: torch.Tensor,
               count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, scale, shift) of the gradient of a BatchNorm's (mean, biased var) with respect to
    its input z: shift + scale * (z - mean) = g_mean / N + 2 g_var (z - mean) / N per channel
    (the path through mean in var vanishes: sum(z - mean) = 0)."""
    return mean, 2 * g_var / count, g_mean / count


@dataclass
class Seed:
    """What starts a tile's backward: the rows of the output gradient that the tile owns
    (_Apply), the gradient of statistics of the output (_Stats; _Apply with out_stats), or
    both added."""
    grad_out: torch.Tensor | None
    affine: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # statistics_affine's

    def rows(self, tile: Tile, factor: int) -> torch.Tensor | None:
        """The rows of grad_out that `tile` owns (grad_out at `factor` x the coarse grid)."""
        if self.grad_out is None:
            return None
        return self.grad_out[..., factor * tile.own[0]:factor * tile.own[1], :]

    def fetch_rows(self, tile: Tile, sweep: "Sweep") -> Fetched:
        """`rows` for `tile` on its way to the sweep's device (a host grad_out, tile:stream,
        is copied in a strip at a time; grad_out spans the sweep's owned rows, so its factor
        over the coarse grid is known before the tile runs)."""
        if self.grad_out is None:
            return Fetched(pending=lambda: None)
        factor = self.grad_out.shape[-2] // sweep.tiles[-1].own[1]
        return fetch(self.rows(tile, factor), sweep.device, sweep.ahead)


def seed_gradient(z: torch.Tensor, rows: torch.Tensor | None,
                  affine: Sequence[torch.Tensor] | None, kernels: str) -> torch.Tensor:
    """The gradient a tile's owned output z starts backward with: `rows` of grad_out, plus
    the statistics' gradient for statistics of z (norm.statistics_seed)."""
    return rows if affine is None else statistics_seed(z, rows, *affine, kernels=kernels)


def _full_like(part: torch.Tensor, inputs: list[torch.Tensor], sweep: Sweep) -> torch.Tensor:
    """The region's full output, in the strips' memory format (channels_last stays so)."""
    total = sweep.tiles[-1].own[1]
    factor = part.shape[-2] // (sweep.tiles[0].own[1] - sweep.tiles[0].own[0])
    shape = (*part.shape[:2], factor * total, part.shape[-1])
    if sweep.host:  # tile:stream: the device holds a strip of it at a time
        return host_empty(shape, part.dtype, part.device, memory_format_of(part))
    return torch.empty(shape, dtype=part.dtype, device=part.device,
                       memory_format=memory_format_of(part))


def backprop_tiles(sweep: Sweep, tensors: list, needs: Sequence[bool], target: int | None,
                   seed: Seed) -> list:
    """Recompute every tile with grad and backpropagate its owned rows (see module docstring);
    returns one gradient (or None) per entry of `tensors` = inputs, flat stats, params."""
    with label(sweep.region, f"{'apply' if target is None else f'stats {target}'} backward"):
        if sweep.graphs is not None:
            grads = sweep.graphs.backward(sweep, tensors, needs, target, seed)
        else:
            grads = backprop_eager(sweep, tensors, needs, target, seed)
    for i in range(sweep.n_inputs):
        if needs[i]:
            grads[i] = sweep.settle(i)
    return grads


def strip_gradient(run: TileRun, full: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """The gradient of the whole strip's output: `owned` in the rows the tile owns, zero in
    the halo, in the strip's memory format. Backpropagating through the crop instead
    (SliceBackward) makes this tensor in the contiguous format whatever the strip's, and on
    channels_last strips every op of the tile's backward after it then mixes layouts: strided
    kernels and conversions (an H100 profile of an 8192 px step: 339 ms of strided elementwise
    kernels and 126 ms of layout copies in 1.92 s of kernels, kernels-8192-layer1-convs.txt)."""
    grad = torch.empty_like(full)
    lo, hi = run.owned_span(full)
    grad[..., :lo, :].zero_()  # the halo rows only: the owned rows are written next
    grad[..., hi:, :].zero_()
    grad[..., lo:hi, :].copy_(owned)
    return grad


def backprop_eager(sweep: Sweep, tensors: list, needs: Sequence[bool], target: int | None,
                   seed: Seed, tiles: Sequence[Tile] | None = None) -> list:
    """backprop_tiles over `tiles` (default: all of the sweep's), tile by tile as written."""
    inputs, stats, params = sweep.unpack(tensors)
    grads: list = [None] * len(tensors)
    device_type, enabled, dtype = sweep.autocast
    # autocast entered once for all tiles: its cache keeps each weight's low-precision copy
    # across them (entered per tile, every convolution recast its weight in every tile)
    with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
        for tile, strips, rows in tile_strips(sweep, inputs, tiles, seed, target):
            _backprop_tile(sweep, tile, strips, rows, inputs, stats, params, needs, target,
                           seed, grads)
    settle(sweep.device)  # the host input gradients' last rows are written
    return grads


def _backprop_tile(sweep: Sweep, tile: Tile, strips: list, rows: torch.Tensor | None,
                   inputs: list, stats: list, params: list, needs: Sequence[bool],
                   target: int | None, seed: Seed, grads: list) -> None:
    """One tile of backprop_eager, given its strips and its rows of grad_out: recompute it
    with grad, add its gradients into `grads` and the region's shared input gradients."""
    region, n = sweep.region, sweep.n_inputs
    strips = [None if s is None else s.detach().requires_grad_(needs[i])
              for i, s in enumerate(strips)]  # None: an input a statistics sweep does not read
    flat = [None if t is None else t.detach().requires_grad_(needs[n + i])
            for i, t in enumerate(flatten_stats(stats))]
    leaves = strips + flat + list(params)
    wanted = [i for i, t in enumerate(leaves) if t is not None and needs[i]]
    if not wanted:
        return
    # the body sees views of the leaf strips: module hooks that watch their inputs'
    # gradients (flop_counter's module tracker) cannot do so on a leaf inside
    # autograd.grad, and a region may start with a convolution of its input strip. An alias
    # (t[...]) keeps the strides; view_as recomputes them, and gives a channels_last strip of
    # batch 1 a batch stride of C, which no longer reads as channels_last: cuDNN's backward
    # then converted every gradient of the strip's first convolution to NCHW and back (an H100
    # profile at 8192 px: 92 ms of one step's copies in region top)
    viewed = [t[...] if t is not None and t.requires_grad else t for t in strips]
    run = TileRun(region, tile, sweep.unpack([*strips, *flat])[1], target)
    full = run.uncropped(viewed)
    got = torch.autograd.grad(full, [leaves[i] for i in wanted],
                              strip_gradient(run, full, seed_gradient(
                                  run.owned(full), rows, seed.affine, region.kernels)),
                              allow_unused=True)
    q0, q1 = tile.strip
    for i, g in zip(wanted, got):
        if g is None:
            continue
        if i < n:  # an input strip: add into the region's shared input gradient
            f = region.input_factors[i]
            sweep.add_input_grad(i, inputs[i], f * q0, f * q1, g)
        else:
            grads[i] = g if grads[i] is None else grads[i] + g


def label(region: Region, sweep: str) -> torch.profiler.record_function:
    """A profiler range naming the region and sweep, so that a profile attributes each kernel
    (memstudy/meters/profile.py, attribution_table)."""
    return torch.profiler.record_function(f"tile:{region.name}:{sweep}")


# -- driving a region ----------------------------------------------------------------------
def autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    return (device_type, torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type))


def run_region(region: Region, tiles: list[Tile], inputs: list[torch.Tensor],
               shared: Sequence[Stats] = (), graphs: Any = None,
               device: torch.device | None = None, host: bool = False, ahead: bool = False
               ) -> tuple[torch.Tensor, list[Stats], Stats | None]:
    """The region's output over the whole image, the statistics every norm used, and those of
    the output for `region.out_norm` (None without one). `device`: where the tiles compute
    (default: where the first input lies); `host`: assemble the output in host memory
    (tile:stream; the inputs may lie there too); `ahead`: host copies on side streams, a
    tile ahead (tile:ahead)."""
    # the inputs are what the region's Functions save: kept boundaries, which transforms
    # restricted to boundaries (offload / compress which=boundaries) must see; backward reads
    # them strip by strip (offload may bring them back by rows)
    mark_boundary(*inputs, rows=True)
    out_norm = region.out_norm
    device = device or inputs[0].device
    sweep = Sweep(region, tiles, autocast_state(device.type), torch.is_grad_enabled(),
                  graphs, out_stats=out_norm is not None and out_norm.training,
                  device=device, host=host, ahead=ahead)
    params = region.params()
    stats: list[Stats | None] = list(shared) + [None] * (len(region.norms) - region.shared)
    counts: dict[int, int] = {}
    for k in range(region.shared, len(region.norms)):
        bn = region.norms[k]
        if not bn.training:
            stats[k] = (bn.running_mean, bn.running_var)
            continue
        with label(region, f"stats {k}"):
            stats[k] = _Stats.apply(sweep, k, counts, *inputs, *flatten_stats(stats), *params)
        update_running_stats(bn, *stats[k], counts[k])
    with label(region, "apply"):
        applied = _Apply.apply(sweep, counts, *inputs, *flatten_stats(stats), *params)
    if out_norm is None:
        return applied, stats, None
    if not sweep.out_stats:  # eval mode: the running statistics normalise the output
        return applied, stats, (out_norm.running_mean, out_norm.running_var)
    out, mean, var = applied
    update_running_stats(out_norm, mean, var, counts["out"])
    return out, stats, (mean, var)


@torch.no_grad()
def update_running_stats(bn: nn.modules.batchnorm._BatchNorm, mean: torch.Tensor,
                         var: torch.Tensor, count: int) -> None:
    """What nn.BatchNorm2d does in a training-mode forward, with the whole image's statistics."""
    if not bn.track_running_stats:
        return
    bn.num_batches_tracked.add_(1)
    factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    unbiased = var * (count / max(count - 1, 1))
    bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype), alpha=factor)
    bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype), alpha=factor)
