"""Tile bodies replayed as CUDA graphs: the tiled step's host cost paid once, not per tile.

Why: a tiled step runs every region's body once per tile and sweep. At 4188 px with 16 tiles
that is over 8,000 kernel launches for the model alone, each a few microseconds of Python,
dispatcher and launch work, against about a thousand untiled: the GPU waits on the host
(docs/techniques/tile.md gives the profile). A CUDA graph records one tile's kernels once and
replays them with a single launch.

What is captured: per region, sweep (a statistics sweep k, the output sweep, or the backward
of either) and strip geometry (strip rows, owned rows within it, input shapes, which leaves need
a gradient) one graph: the body's forward with the moments of the owned rows (statistics
sweeps), with the owned output (output sweep), or the body's recomputation and
`torch.autograd.grad` (backward, as `torch.cuda.make_graphed_callables` captures it). Equal
strips share a graph, so a 16-tile plan captures the first, the middle (one or two row counts)
and the last tile's shapes: a few graphs per sweep, captured in the first training step.

Fixed addresses: a graph reads and writes the same memory at every replay. So each tile's input
strips, the sweep's statistics and, in backward, the tile's output gradient are copied into
staging buffers (one per region and role, sized for the largest strip of the plan), and the
graph writes its results into staging buffers too: the moments, the owned output, each input
strip's gradient (added into the region's input gradient outside the graph), and the gradients
of statistics and parameters, which the graph adds into accumulators zeroed per sweep. The copies
cost a strip's bytes, a small share of the body's own traffic. Everything else a graph allocates
comes from one memory pool shared by all graphs of a tiled forward, in the caching allocator:
its reserved bytes count against a budget like any other (replays run one after another on one
stream, as sharing a pool requires).

Exactness: a replay runs the kernels the eager body runs, on the same values, so gradients equal
the eager tiled step's (tests/test_tiling.py compares both with the untiled step in float64;
`Emulated` below runs the same staging logic on the CPU, so a graph body that read anything
but its staging buffers fails there as it would on a GPU).

Cost and limits: each capture happens once per geometry (first step, unmeasured warm-up), with
the capture's synchronisation, one eager warm-up run (cuDNN's algorithm choice) and the pool's
memory. A run whose strips keep changing shape (native image sizes) would capture every step:
past `limit` graphs the run stops with an error naming tile:graph_limit, or, with
tile:graph_fallback=true, runs further geometries eagerly and records how many tiles did.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from memstudy.errors import ConfigError
from memstudy.runtime import ROWS_IN
from memstudy.tiling.geometry import Tile
from memstudy.models.unet import memory_format_of
from memstudy.tiling.norm import moments


MOMENTS_CAPACITY = 4096  # channels: more than any tiled BatchNorm of the U-Net has


class CudaGraphs:
    """Capture on CUDA: one eager warm-up run on a side stream (cuDNN autotuning, lazy
    initialisation: neither may happen during a capture), then the capture into the shared pool."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, body: Callable[[bool], None]) -> Callable[[], None]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body(False)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            body(True)
        return graph.replay


class Emulated:
    """The capture contract without CUDA (CPU tests): the body runs once as the warm-up, and each
    replay runs it again on the staging buffers, which is all a graph can read."""

    def capture(self, body: Callable[[bool], None]) -> Callable[[], None]:
        body(False)
        return lambda: body(True)


@dataclass
class Captured:
    replay: Callable[[], None]
    facts: dict  # what the capture fixed: staging views of its outputs, counts, leaves with grads


class TileGraphs:
    """The captured tile bodies of one tiled forward, their staging buffers and accumulators."""

    def __init__(self, backend: CudaGraphs | Emulated, limit: int = 256, fallback: bool = False,
                 record: dict | None = None):
        self.backend, self.limit, self.fallback = backend, limit, fallback
        self.graphs: dict[tuple, Captured] = {}
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.record = record if record is not None else {}
        self.record.update(graphs_captured=0, eager_tiles=0)

    # -- staging ---------------------------------------------------------------------------
    def _staged(self, key: tuple, shape, like: torch.Tensor, capacity: int = 0) -> torch.Tensor:
        """A tensor at a fixed address of `shape` in like's dtype and memory format, in staging
        buffer `key` (allocated for `capacity` elements or more; graphs that read an older,
        smaller buffer are dropped when it must grow)."""
        numel = math.prod(shape)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype \
                or buf.device != like.device:
            if buf is not None:
                self.graphs.clear()  # they read the old buffer's address
            buf = torch.empty(max(numel, capacity), dtype=like.dtype, device=like.device)
            self.buffers[key] = buf
        if len(shape) == 4 and memory_format_of(like) == torch.channels_last:
            n, c, h, w = shape
            return buf[:numel].view(n, h, w, c).permute(0, 3, 1, 2)
        return buf[:numel].view(shape)

    def _copied(self, key: tuple, t: torch.Tensor, capacity: int = 0) -> torch.Tensor:
        view = self._staged(key, t.shape, t, capacity)
        view.copy_(t)
        return view

    def _strips(self, sweep, tile: Tile, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tile's input strips, copied into the region's input buffers (each sized for the
        plan's tallest strip)."""
        q0, q1 = tile.strip
        tallest = max(t.strip[1] - t.strip[0] for t in sweep.tiles)
        for x, f in zip(inputs, sweep.region.input_factors):
            ROWS_IN.await_rows(x, f * q0, f * q1)  # an input offload brings back by rows
        return [self._copied(("in", sweep.region.name, i), x[..., f * q0:f * q1, :],
                             f * tallest * x[..., :1, :].numel())
                for i, (x, f) in enumerate(zip(inputs, sweep.region.input_factors))]

    def _flat_stats(self, sweep, flat: Sequence) -> list:
        """The sweep's flat statistics (None where not computed yet) in staging buffers."""
        return [None if t is None else self._copied(("stat", sweep.region.name, j), t)
                for j, t in enumerate(flat)]

    # -- capture / replay ----------------------------------------------------------------------
    def _key(self, kind: str, sweep, tile: Tile, inputs, extra: tuple = ()) -> tuple:
        (a, b), (q0, q1) = tile.own, tile.strip
        shapes = tuple((tuple(x.shape[:2]), x.shape[-1], x.dtype, memory_format_of(x))
                       for x in inputs)
        return (kind, sweep.region.name, q1 - q0, a - q0, b - q0, shapes, sweep.autocast) + extra

    def _replayed(self, key: tuple, body: Callable[[bool, dict], None]) -> dict | None:
        """Replay the graph of `key` (captured from `body` first if new); its facts, or None
        when the limit is reached and fallback allowed (the caller runs the tile eagerly)."""
        found = self.graphs.get(key)
        if found is None:
            if len(self.graphs) >= self.limit:
                if not self.fallback:
                    raise ConfigError(
                        f"tile: {self.limit} CUDA graphs captured and the strips keep changing "
                        "shape (e.g. native image sizes): raise tile:graph_limit, set "
                        "tile:graph_fallback=true to run further shapes eagerly, or set "
                        "tile:graphs=false")
                self.record["eager_tiles"] += 1
                return None
            facts: dict = {}
            try:
                replay = self.backend.capture(lambda accumulate: body(accumulate, facts))
            except torch.OutOfMemoryError as exc:
                raise torch.OutOfMemoryError(
                    f"tile: capturing region {key[1]}'s {key[0]} graph ran out of memory (the "
                    "graphs' pool keeps one tile's working memory for the whole step): use more "
                    f"tiles (tile:N) or tile:graphs=false. {exc}") from exc
            found = self.graphs[key] = Captured(replay, facts)
            self.record["graphs_captured"] = len(self.graphs)
        found.replay()
        return found.facts

    @staticmethod
    def _local(tile: Tile) -> Tile:
        """The tile in its own strip's coordinates (all the body's cropping needs)."""
        (a, b), (q0, q1) = tile.own, tile.strip
        return Tile((a - q0, b - q0), (0, q1 - q0))

    @staticmethod
    def _autocast(sweep):
        device_type, enabled, dtype = sweep.autocast
        # no cast cache inside a capture: a cached cast would be pool memory across replays
        return torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False)

    # -- the three kinds of tile work ----------------------------------------------------------
    def moments(self, sweep, tile: Tile, inputs, stats, k: int):
        """(count, mean, var) of z_k over the tile's owned rows (a statistics sweep)."""
        from memstudy.tiling.sweep import TileRun, flatten_stats, strips_of

        strips = self._strips(sweep, tile, inputs)
        staged = sweep.unpack([*strips, *self._flat_stats(sweep, flatten_stats(stats))])[1]
        local, region = self._local(tile), sweep.region

        def body(_: bool, facts: dict) -> None:
            with self._autocast(sweep):
                z = TileRun(region, local, staged, target=k)(strips)
            n, mean, var = moments(z, region.kernels)
            facts.setdefault("n", n)
            if "mean" not in facts:  # one buffer for every region: sized for any channel count
                facts["mean"] = self._staged(("moments", 0), mean.shape, mean, MOMENTS_CAPACITY)
                facts["var"] = self._staged(("moments", 1), var.shape, var, MOMENTS_CAPACITY)
            facts["mean"].copy_(mean)
            facts["var"].copy_(var)

        facts = self._replayed(self._key("moments", sweep, tile, inputs, (k,)), body)
        if facts is None:
            return moments(TileRun(region, tile, stats, target=k)(strips_of(region, tile, inputs)),
                           region.kernels)
        # copies: the next tile's replay overwrites the buffers, and merge keeps what it gets
        return facts["n"], facts["mean"].clone(), facts["var"].clone()

    def output(self, sweep, tile: Tile, inputs, stats) -> torch.Tensor:
        """The tile's owned output rows: a view of a staging buffer, valid until the next tile."""
        from memstudy.tiling.sweep import TileRun, flatten_stats, strips_of

        strips = self._strips(sweep, tile, inputs)
        staged = sweep.unpack([*strips, *self._flat_stats(sweep, flatten_stats(stats))])[1]
        local, region = self._local(tile), sweep.region
        owned = max(b - a for a, b in (t.own for t in sweep.tiles))

        def body(_: bool, facts: dict) -> None:
            with self._autocast(sweep):
                part = TileRun(region, local, staged)(strips)
            if "out" not in facts:
                factor = part.shape[-2] // (local.own[1] - local.own[0])
                facts["out"] = self._staged(("out", region.name), part.shape, part,
                                            owned * factor * part[..., :1, :].numel())
            facts["out"].copy_(part)

        facts = self._replayed(self._key("output", sweep, tile, inputs), body)
        if facts is None:
            return TileRun(region, tile, stats)(strips_of(region, tile, inputs))
        return facts["out"]

    def backward(self, sweep, tensors: list, needs: Sequence[bool], target: int | None,
                 seed) -> list:
        """Every tile's recomputation and backward, replayed. Input strips' gradients are added
        into the sweep's shared input gradients; returns the statistics' and parameters'
        gradients (None for the inputs, which `backprop_tiles` settles)."""
        from memstudy.tiling.sweep import backprop_eager

        n = sweep.n_inputs
        accumulators = {i: self._staged(("acc", sweep.region.name, i), t.shape, t)
                        for i, t in enumerate(tensors) if i >= n and t is not None and needs[i]}
        for acc in accumulators.values():
            acc.zero_()
        received: set[int] = set()
        for tile in sweep.tiles:
            got = self._backward_tile(sweep, tile, tensors, needs, target, seed, accumulators)
            if got is None:  # past the graph limit, with fallback: this tile eagerly
                one = backprop_eager(sweep, tensors, needs, target, seed, tiles=[tile])
                got = [i for i in accumulators if one[i] is not None]
                for i in got:
                    accumulators[i].add_(one[i])
            received.update(got)
        return [accumulators[i].clone() if i in received else None for i in range(len(tensors))]

    def _backward_tile(self, sweep, tile: Tile, tensors, needs, target, seed,
                       accumulators) -> list[int] | None:
        from memstudy.tiling.sweep import TileRun, flatten_stats, seed_gradient, strip_gradient

        region, n = sweep.region, sweep.n_inputs
        inputs, stats, params = sweep.unpack(tensors)
        strips = self._strips(sweep, tile, inputs)
        flat = self._flat_stats(sweep, flatten_stats(stats))
        rows, affine = self._seed(sweep, tile, seed)
        local = self._local(tile)

        def body(accumulate: bool, facts: dict) -> None:
            with torch.enable_grad(), self._autocast(sweep), \
                    _aliased(region.modules, params) as aliases:
                leaves_in = [s.detach().requires_grad_(needs[i]) for i, s in enumerate(strips)]
                leaves_flat = [None if t is None else t.detach().requires_grad_(needs[n + j])
                               for j, t in enumerate(flat)]
                leaves = leaves_in + leaves_flat + aliases
                run = TileRun(region, local, sweep.unpack([*leaves_in, *leaves_flat])[1], target)
                full = run.uncropped(leaves_in)
                grad_full = strip_gradient(run, full, seed_gradient(run.owned(full), rows, affine,
                                                                       region.kernels))
                wanted = [i for i, t in enumerate(leaves) if t is not None and needs[i]]
                got = torch.autograd.grad(full, [leaves[i] for i in wanted], grad_full,
                                          allow_unused=True)
            facts["received"] = [i for i, g in zip(wanted, got) if g is not None]
            for i, g in zip(wanted, got):
                if g is not None and i < n:
                    view = facts.setdefault(("gin", i), self._staged(
                        ("gin", region.name, i), g.shape, inputs[i],
                        self.buffers[("in", region.name, i)].numel()))
                    view.copy_(g)
                elif g is not None and accumulate:
                    accumulators[i].add_(g)

        key = self._key("backward", sweep, tile, inputs,
                        (target, tuple(needs), rows is None, affine is None))
        facts = self._replayed(key, body)
        if facts is None:
            return None
        q0, q1 = tile.strip
        for i in facts["received"]:
            if i < n:
                f = region.input_factors[i]
                sweep.input_grad(i, inputs[i])[..., f * q0:f * q1, :] += facts[("gin", i)]
        return [i for i in facts["received"] if i >= n]

    def _seed(self, sweep, tile: Tile, seed) -> tuple:
        """What starts a tile's backward (memstudy.tiling.sweep.Seed), staged: the tile's rows
        of the output gradient and (mean, scale, shift) of the statistics' gradient, each None
        where the seed has none."""
        name = sweep.region.name
        rows = affine = None
        if seed.affine is not None:
            affine = [self._copied(("seed", name, which), t)
                      for which, t in enumerate(seed.affine)]
        if seed.grad_out is not None:
            factor = seed.grad_out.shape[-2] // sweep.tiles[-1].own[1]
            owned = max(b - a for a, b in (t.own for t in sweep.tiles))
            part = seed.rows(tile, factor)
            rows = self._copied(("gout", name), part, owned * factor * part[..., :1, :].numel())
        return rows, affine


@contextlib.contextmanager
def _aliased(modules: Sequence[torch.nn.Module], params: Sequence[torch.Tensor]):
    """The modules' parameters `params` replaced, while inside, by leaves made here that share
    their storage. Why: a parameter's own autograd leaf (its AccumulateGrad node) was made on the
    default stream in the step's forward; differentiating with respect to it inside a capture
    on a side stream would make the default stream a dependency of the capture, which CUDA
    refuses. The aliases read the same memory, which the optimizer updates in place, so every
    replay sees the current weights."""
    wanted = {id(p): p for p in params}
    aliases: dict[int, torch.Tensor] = {}
    swapped = []
    for module in (sub for m in modules for sub in m.modules()):
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in wanted:
                alias = aliases.setdefault(id(p), p.detach().requires_grad_(True))
                swapped.append((module, name, p))
                module._parameters[name] = alias
    try:
        yield [aliases[id(p)] for p in params]
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
