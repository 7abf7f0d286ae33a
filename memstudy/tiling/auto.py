"""tile:auto: tile's levels, strips and streaming picked from the budget and the image.

A plan is one of three measured ways to tile (a set of PLANS, PLAN_SETS[tile:plans], fastest
first): levels=2 with every decoder convolution kept, levels=3 with layer1 cut at its
convolutions, levels=4 with its boundaries in host memory (`stream`) and layer1 and layer2 cut
at their blocks (plan set 2, the default) or convolutions (set 1, what runs recorded before
2026-11-29 picked among). Its strips are the tallest that fit: fewer strips are fewer halo rows
recomputed and fewer launches.

What fits is predicted by a model of the training step's device peak (its backward's: the
loss and validation size their blocks from the memory left, memstudy/quality.py):

    peak = state + c + ku * v * H * W * e + kw * t * (rows + halo) * W * e  (+ a * (rows + halo) * W)

`state`: parameters and gradients (float32), and Adam's two moments unless offload_optim
holds them; `v`: the largest checkpointed unit below the tiled levels (a residual or decoder
block: the leaf outputs inside it, its input and its output), `t`: every leaf output inside
them, both in elements per full-resolution pixel, counted on the meta device (in-place outputs
left out), so a ResNet-50 or ResNeXt encoder scales the prediction by its own shapes; `e`:
bytes per element (2 under amp, else 4); `rows + halo`: one strip's rows; `a`, streamed plans
only, with tile:ahead=true: the bytes per row a sweep holds beside the computing tile
because its copies run a tile ahead (the next tile's strips, the previous one's gradient rows
being written back), counted from the regions' host inputs (TiledForward.fetched_ahead_bytes),
not fitted. The constants c, ku,
kw are fitted per plan, by least squares, to the allocator peaks measured on an H200
(CALIBRATION: 2048 and 4096 px, 256 and 1024 rows, benchmarks/results/h200/auto-calibration/
and auto-calibration-layer1/);
they predict the streamed 8192-16384 px steps 5-15% above what they measured, on the safe
side, tile:auto's own runs at 4188-16384 px 0.4-17% above their backward peaks
(benchmarks/results/h200/auto-blocks/), and the peaks of ResNet-18 and ResNet-50 U-Nets under
tile:auto within 2% and 17-27% above (benchmarks/results/h200/networks-auto/; all in
tests/test_tile_auto.py). The allowance
for the CUDA context is its size after warm-up on that H200; the run records the context it
actually measured (docs/budget.md), and a GPU with a larger one leaves less: hence the MARGIN.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from memstudy.byte_sizes import size_text
from memstudy.errors import ConfigError
from memstudy.models.unet import STRIDE
from memstudy.tiling.levels import AUTO_PLAN_SETS, min_tile_rows

MIB = 1 << 20
# name -> (levels, keep, layer1, stream): the plans, each set's fastest first (measured at 4096
# px, 1024 rows, H200: 0.242 / 0.361 / 0.727 s a step, results/h200/auto-calibration/size-4096/;
# levels4-stream-blocks 0.676 s, auto-calibration-layer1/size-4096/)
PLANS = {
    "levels2": (2, "all", "whole", False),
    "levels3": (3, "conv1", "convs", False),
    "levels4-stream": (4, "conv1", "convs", True),
    "levels4-stream-blocks": (4, "conv1", "blocks", True),
}
# tile:plans -> the plans tile:auto picks among, fastest first. 2 streams with the tiled
# residual stages cut at their blocks, not their convolutions: fewer kept outputs to copy out
# and back, and on an H200 at 16384 px under 8 GiB, 752-row strips, 5.718 s a step against
# 6.722 s in the same run (results/h200/stream-layer1-16384/); 1 is what runs recorded before
# 2026-11-29 picked among
PLAN_SETS = dict(zip(AUTO_PLAN_SETS, (
    ("levels2", "levels3", "levels4-stream"),
    ("levels2", "levels3", "levels4-stream-blocks"),
), strict=True))
# (plan, side px, rows, the backward's absolute allocator peak in MiB): resnet34 U-Net,
# amp:bf16, checkpoint, offload:which=boundaries, batch 1, unconstrained, Adam on the device;
# NVIDIA H200, 2026-11-28, benchmarks/results/h200/auto-calibration/size-*/native.sqlite
CALIBRATION = [
    ("levels2", 2048, 256, 732.4), ("levels2", 2048, 1024, 977.1),
    ("levels2", 4096, 256, 1920.9), ("levels2", 4096, 1024, 2412.9),
    ("levels3", 2048, 256, 609.5), ("levels3", 2048, 1024, 971.7),
    ("levels3", 4096, 256, 1353.6), ("levels3", 4096, 1024, 2071.2),
    ("levels4-stream", 2048, 256, 457.6), ("levels4-stream", 2048, 1024, 824.0),
    ("levels4-stream", 4096, 256, 741.6), ("levels4-stream", 4096, 1024, 1416.4),
    # the same, copies on the compute stream (ahead=false), 2026-11-29,
    # benchmarks/results/h200/auto-calibration-layer1/size-*/native.sqlite
    ("levels4-stream-blocks", 2048, 256, 465.6), ("levels4-stream-blocks", 2048, 1024, 824.0),
    ("levels4-stream-blocks", 4096, 256, 741.6), ("levels4-stream-blocks", 4096, 1024, 1416.4),
]
CALIBRATION_NETWORK = ("resnet34", 16)  # encoder, state bytes per parameter (Adam on device)
# the largest measured there (stream-4188-2gib/native.sqlite: 1352 MiB) less the 616 MiB NVML
# counted as used before the process started (memstudy.budget.note_baseline), then included
CONTEXT_AFTER_WARMUP = 736 * MIB
MARGIN = 0.9  # of what the context leaves: the model's error, a larger context, fragmentation
# a faster plan is taken only with strips at least this tall (or the image): each strip costs
# the host its launches, and at 8192 px under 8 GiB levels2's 20 strips of 412 rows took 0.911 s
# where levels3's 7 of 1176 took 0.794 s (H200, benchmarks/results/h200/auto/)
MIN_ROWS = 512


@dataclass(frozen=True)
class Pick:
    """What tile:auto chose, and why: recorded in the run's notes (tile.auto)."""
    plan: str
    levels: int
    keep: str
    layer1: str
    stream: bool
    rows: int
    predicted_bytes: int
    available_bytes: int

    def record(self) -> dict:
        return {"plan": self.plan, "rows": self.rows, "predicted_peak_bytes":
                self.predicted_bytes, "available_bytes": self.available_bytes}

    def says(self) -> str:
        """One line for the person who started the run."""
        return (f"tile:auto picked {self.plan}: levels={self.levels}, {self.rows}-row strips, "
                f"stream={self.stream} (predicted peak {self.predicted_bytes / MIB:.0f} MiB of "
                f"{self.available_bytes / MIB:.0f} MiB planned beside the CUDA context)")


def pick(height: int, width: int, batch: int, budget: int, network, task: str,
         amp: bool, optim_on_device: bool, ahead: bool, plans: int) -> Pick:
    """The fastest plan of the set `plans` (tile:plans), with its tallest strips, whose
    predicted peak fits `budget` (bytes, CUDA context included) for a padded height x width;
    ConfigError when none does. `ahead`: a streamed plan's copies run a tile ahead (tile:ahead,
    true by default)."""
    key = (network.encoder, tuple(network.decoder_channels), network.in_channels,
           network.classes, task)  # a hashable ModelConfig: the picks are cached
    return _pick(height, width, batch, budget, key, amp, optim_on_device, ahead, plans)


@lru_cache(maxsize=16)
def _pick(height, width, batch, budget, key, amp, optim_on_device, ahead, plans) -> Pick:
    available = int((budget - CONTEXT_AFTER_WARMUP) * MARGIN)
    shapes = _Shapes.of(key)
    encoder = key[0]
    element = 2 if amp else 4
    state = shapes.parameters * (16 if optim_on_device else 8)
    last = PLAN_SETS[plans][-1]
    for name in PLAN_SETS[plans]:
        levels, keep, layer1, stream = PLANS[name]
        halo = min_tile_rows(levels, keep, layer1, encoder)
        floor = max(2 * halo, 2 ** levels) if name == last else min(MIN_ROWS, height)
        early = _fetched_ahead_row_bytes(key, levels, keep, layer1, element) \
            if stream and ahead else 0
        for rows in _strip_heights(height, 2 ** levels, floor):
            predicted = state + _activations(name, shapes, levels, height, width,
                                             rows + halo, element, batch) \
                + early * batch * width * (rows + halo)
            if predicted <= available:
                return Pick(name, levels, keep, layer1, stream, rows, int(predicted),
                            available)
    raise ConfigError(
        f"tile:auto finds no plan for {height} x {width} px (padded), batch {batch}, under "
        f"{size_text(budget)}: even {last} with its narrowest strips is predicted to need "
        f"more than the {size_text(max(available, 0))} left beside the CUDA context; raise "
        "the budget, lower the size or batch, or add offload_optim")


def _strip_heights(height: int, unit: int, floor: int):
    """Strip heights from the whole image down to `floor`, multiples of `unit`, tallest first:
    one per strip count."""
    seen = set()
    for strips in range(1, height // unit + 1):
        rows = -(-height // strips // unit) * unit
        if rows < floor:
            return
        if rows not in seen:
            seen.add(rows)
            yield rows


def _activations(plan: str, shapes: "_Shapes", levels: int, height: int, width: int,
                 strip_rows: int, element: int, batch: int = 1) -> float:
    """The model's peak beside the state: its constant, and per image the untiled levels'
    and one strip's bytes."""
    c, ku, kw = _fitted()[plan]
    below, inside = shapes.split(levels)
    return c + batch * element * width * (ku * below * height + kw * inside * strip_rows)


@lru_cache(maxsize=16)
def _fetched_ahead_row_bytes(key: tuple, levels: int, keep: str, layer1: str,
                             element: int) -> float:
    """Bytes per strip row and image column that a streamed sweep holds beside the computing
    tile when its copies run a tile ahead (TiledForward.fetched_ahead_bytes). Not in CALIBRATION, whose streamed peaks were measured
    before the copies ran a tile ahead: added as counted, not fitted."""
    import torch

    from memstudy.models import build_unet
    from memstudy.network import ModelConfig
    from memstudy.tiling.tiled_forward import TiledForward

    encoder, decoder, in_channels, classes, task = key
    network = ModelConfig(encoder=encoder, decoder_channels=list(decoder),
                          in_channels=in_channels, classes=classes)
    with torch.device("meta"):
        unet = build_unet(network=network, task=task)
    tiled = TiledForward(unet, levels, 0, 0, keep, None, layer1, "torch", stream=True,
                         ahead=True)
    return tiled.fetched_ahead_bytes(1, 1, element)


@lru_cache(maxsize=1)
def _fitted() -> dict[str, tuple[float, float, float]]:
    """(c, ku, kw) per plan: the least-squares fit of the model to CALIBRATION."""
    import numpy as np

    from memstudy.network import DEFAULT_DECODER_CHANNELS

    encoder, per_parameter = CALIBRATION_NETWORK
    shapes = _Shapes.of((encoder, tuple(DEFAULT_DECODER_CHANNELS), 1, 1, "enhance"))
    fits = {}
    for name, (levels, keep, layer1, _) in PLANS.items():
        halo = min_tile_rows(levels, keep, layer1, encoder)
        below, inside = shapes.split(levels)
        points = [(side, rows, peak) for plan, side, rows, peak in CALIBRATION if plan == name]
        terms = np.array([[1.0, below * side * side * 2, inside * (rows + halo) * side * 2]
                          for side, rows, _ in points])
        measured = np.array([peak * MIB - shapes.parameters * per_parameter
                             for *_, peak in points])
        fits[name] = tuple(float(v) for v in np.linalg.lstsq(terms, measured, rcond=None)[0])
    return fits


@dataclass(frozen=True)
class _Shapes:
    """A network's parameters, its activation elements per full-resolution pixel at each
    down-sampling (1, 2, 4 .. 32): the outputs of its leaf modules, and each checkpointed unit's
    (residual block, decoder block) working set: the leaf outputs inside it, its input and its
    output. All counted on the meta device."""
    parameters: int
    per_pixel: tuple[tuple[int, float], ...]
    units: tuple[tuple[int, float], ...]  # (the unit output's down-sampling, its working set)

    def split(self, levels: int) -> tuple[float, float]:
        """(elements per pixel of the largest unit below the tiled levels, all of them inside).
        Below, checkpoint recomputes one unit at a time and offload holds its boundaries on the
        host, so the untiled levels' peak follows their largest unit, not their sum: ResNet-18's
        peak is ResNet-34's, whose blocks it shares, where the sum of its leaf outputs predicted
        it 19% low (H200, 2026-11-29; tests/test_tile_auto.py)."""
        below = max(n for down, n in self.units if down >= 2 ** levels)
        return below, sum(n for down, n in self.per_pixel if down < 2 ** levels)

    @staticmethod
    @lru_cache(maxsize=8)
    def of(key: tuple) -> "_Shapes":
        """key: (encoder, decoder channels, in channels, classes, task)."""
        import torch

        from memstudy.models import build_unet
        from memstudy.network import ModelConfig

        encoder, decoder, in_channels, classes, task = key
        network = ModelConfig(encoder=encoder, decoder_channels=list(decoder),
                              in_channels=in_channels, classes=classes)
        side = 8 * STRIDE
        with torch.device("meta"):
            unet = build_unet(network=network, task=task)
        counts: dict[int, float] = {}
        units: list[tuple[int, float]] = []
        inside = [0.0]  # leaf outputs of the unit running now

        def elements_per_pixel(t) -> float:
            return t.numel() / side ** 2

        def count(module, _inputs, out):
            # an in-place op's output is its input's storage (ReLU(inplace=True) in every block)
            fresh = not getattr(module, "inplace", False)
            if isinstance(out, torch.Tensor) and out.dim() == 4 and fresh:
                down = side // out.shape[-2]
                counts[down] = counts.get(down, 0.0) + elements_per_pixel(out)
                inside[0] += elements_per_pixel(out)

        def unit_starts(_module, _inputs):
            inside[0] = 0.0

        def unit_ends(_module, inputs, out):
            units.append((side // out.shape[-2],
                          inside[0] + elements_per_pixel(inputs[0]) + elements_per_pixel(out)))

        leaves = [m for m in unet.modules() if not list(m.children())]
        blocks = [*(b for stage in unet.residual_stages for b in stage), *unet.decoder_blocks]
        hooks = [m.register_forward_hook(count) for m in leaves]
        hooks += [b.register_forward_pre_hook(unit_starts) for b in blocks]
        hooks += [b.register_forward_hook(unit_ends) for b in blocks]
        try:
            with torch.no_grad():
                unet(torch.empty(1, in_channels, side, side, device="meta"))
        finally:
            for hook in hooks:
                hook.remove()
        return _Shapes(sum(p.numel() for p in unet.parameters()), tuple(sorted(counts.items())),
                       tuple(units))
