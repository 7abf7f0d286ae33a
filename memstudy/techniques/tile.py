"""tile: the U-Net's full- and half-resolution levels run tile by tile, exactly, BatchNorm included.

Memory / compute trade-off: at large images the floor of every other technique is the top of
the U-Net - the stem and the last decoder blocks hold few channels but millions of pixels, and
checkpointing still materialises a whole full-resolution block when it recomputes it. `tile`
splits those levels into full-width row strips, each computed from its input strip plus a halo
(its receptive field), and keeps only the region boundaries alive: the input image, the 1/4-res
stem output and decoder block 2's output (levels=2), the network output, and with `keep=conv1`
the first convolution output (before its BatchNorm) of each tiled decoder block with a skip. Nothing of the
tiled levels is saved for backward; backward recomputes each tile. BatchNorm stays exact in
training mode: each tiled BatchNorm's batch statistics are those of the whole image, computed by
a statistics sweep over tiles before it normalises anything, and they are differentiable tensors
whose gradients (the BatchNorm's global reductions) flow back through the same tiles
(memstudy/tiling/sweep.py). The price is compute: a region with K BatchNorms runs K + 1 forward
sweeps and K + 1 backward sweeps (each sweep recomputes the region up to that BatchNorm, plus
halo rows). At levels=2 the stem region has 1 BatchNorm, the top region 4 (plus the stem's
shared one, recomputed per tile), so the tiled levels cost several times their untiled forward.
`keep=conv1` cuts that recomputation where it is most expensive: decoder block 3's first
convolution (128 input channels at half resolution, the tiled levels' costliest) then runs once
per sweep of its own small region instead of in every sweep of the top region, for one more kept
half-resolution tensor (32 channels). Measured: docs/techniques/tile.md.

Host cost: a tile body is a few hundred small kernels, launched per tile and sweep; with many
tiles the GPU waits on the host. `graphs=true` replays each body as a CUDA graph captured once
per region, sweep and strip shape (memstudy/tiling/graphs.py): same kernels, same values, one
launch per tile, for staging copies of each strip and a memory pool that holds one tile's
working memory for the whole step.

Options (`tile:4`, `tile:rows=512`, `tile:4:levels=1`, `tile:16:keep=conv1`, `tile:16:graphs=true`):
- `tiles` (positional): number of row strips (near-equal; 0 with rows=0 means 4), or `auto`:
  levels, keep, layer1, rows and stream picked from the budget and the image by a memory model
  fitted to measured peaks (memstudy/tiling/auto.py; needs checkpoint, offload and a budget);
- `rows`: rows per strip at full resolution instead (a multiple of 2**levels; the last strip
  may be shorter);
- `levels`: 2 = full + half resolution (stem, decoder blocks 3-4, head); 1 = full resolution
  only (decoder block 4 and head); 3 = also 1/4 resolution (layer1, decoder block 2);
- `keep`: `none` (one decoder region), `conv1` (also keep each tiled skip block's first
  convolution output: fewer sweeps, one more tensor per such block), `all` (every tiled
  decoder block's first convolution output, block 4's at full resolution too), `half` (every
  BatchNorm's input but block 4's second convolution output: one sweep per region each way
  except the full-resolution top's two, for the backward peak of `all`) or `bn` (every
  BatchNorm's input, the stem's convolution output included: one sweep per region each way,
  the most kept tensors);
- `layer1` (levels=3): `whole` (layer1 inside the stem's region, whose 7 BatchNorms cost 8
  sweeps each way over it), `blocks` (one region per BasicBlock, its input kept at 1/4 res:
  3 sweeps each) or `convs` (also each block's first convolution output: 1 + 2 sweeps);
- `plans` (auto only): which plans auto picks among: 2 (the default: streamed with the
  residual stages cut at their blocks) or 1 (at their convolutions, as before 2026-11-29);
- `norm`: the tiled BatchNorms' kernels on CUDA: `triton` (memstudy/tiling/norm_act.py: one
  pass each for a strip's moments, its normalisation + ReLU and their backward), `torch`
  (PyTorch's SyncBatchNorm primitives, five passes for the last two), `auto` (triton on CUDA).
Composes with amp, checkpoint:block / selective and invertible (they act on the untiled levels;
the decoder blocks and stem that tile runs are not run through their wrapped forward), offload
and saved-tensor compression (they see the region boundaries, which tile's Functions save), dp,
compile (it compiles the untiled levels' modules; the tiled regions stay eager, or graphed).
Refused: checkpoint:sqrt (it replaces the encoder/decoder forward that tile runs stage by stage),
mp / pipeline / fsdp (the model is split or its parameters sharded), quantization (fake
quantizers would observe each tile separately), tri_accel:precision (per-unit autocast set by
wrapping block forwards that tile bypasses).
"""
from __future__ import annotations

from dataclasses import replace

from memstudy.errors import ConfigError
from memstudy.kernels import resolve_impl
from memstudy.models.unet import STRIDE
from memstudy.streaming import TRAFFIC
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import AUTO, DEFAULT_TILES
from memstudy.techniques.options import TileOptions as Options
from memstudy.tiling.graphs import CudaGraphs, TileGraphs
from memstudy.tiling.levels import NETWORK_LEVELS, min_tile_rows
from memstudy.tiling.tiled_forward import TiledForward

# technique -> why it cannot run with tile
CONFLICTS = {
    "mp": "splits the model across devices, tile runs it whole",
    "pipeline": "splits the model into stages, tile runs it whole",
    "fsdp": "shards the parameters that tile reads from the modules per tile",
    "quantization": "its fake quantizers would observe every tile separately (not exact)",
}


def resolved(opts: Options) -> Options:
    return replace(opts, tiles=opts.tiles or (0 if opts.rows else DEFAULT_TILES))


def concrete(opts: Options, plan: Plan) -> Options:
    """The options a run tiles with: tile:auto's pick (memstudy/tiling/auto.py) spelled out,
    any other options as given. tile:auto copies a tile ahead (tile:ahead, true by default)
    where its pick streams; a pick that streams nothing has no host copies to run ahead."""
    if opts.tiles != AUTO:
        return opts
    return replace(opts, tiles=0, rows=(chosen := auto_pick(plan)).rows, levels=chosen.levels,
                   keep=chosen.keep, layer1=chosen.layer1, stream=chosen.stream,
                   ahead=opts.ahead and chosen.stream, plans=None)


def auto_pick(plan: Plan):
    """tile:auto's pick for this run, or a ConfigError naming what it needs."""
    from memstudy.image_sizes import size_hw
    from memstudy.tiling import auto

    train = plan.config.train
    if plan.budget_bytes is None:
        raise ConfigError("tile:auto plans the strips for a memory budget; give one (your "
                          "card's memory, e.g. --budget 24GiB) or give tile's strips by hand")
    missing = [name for name in ("checkpoint", "offload") if not plan.has(name)]
    if missing:
        raise ConfigError(f"tile:auto's memory model was measured with checkpoint and offload "
                          f"(docs/techniques/tile.md, \"tile:auto\"); add {', '.join(missing)}, "
                          "or give tile's strips by hand")
    more = keeps_more_than_measured(plan.chosen["checkpoint"], plan.chosen["offload"])
    if more:
        raise ConfigError(f"tile:auto's memory model was measured with checkpoint:block and "
                          f"offload:prefetch=1:hold=0; {more} keeps more on the device than that, "
                          "so its prediction would be low: use checkpoint:block and offload's "
                          "prefetch <= 1 and hold <= 1, or give tile's strips by hand")
    hw = size_hw(train.image_size)
    if hw is None:
        raise ConfigError("tile:auto plans for one image size, and native images each have "
                          "their own; give train.image_size (e.g. 4188 or 4188x3500) or tile's "
                          "strips by hand (tile:rows=512)")
    height, width = (-(-side // STRIDE) * STRIDE for side in hw)
    return auto.pick(height, width, train.batch_size, plan.budget_bytes, plan.config.model,
                     train.task, plan.has("amp"), not plan.has("offload_optim"),
                     plan.chosen["tile"].ahead, plan.chosen["tile"].plans)


def keeps_more_than_measured(checkpoint, offload) -> str:
    """The options beside tile:auto that keep more on the device than those its model was
    fitted with ('' if none): another checkpoint placement keeps other tensors (`selective` its
    convolutions' outputs), a deeper prefetch or more than one held boundary more of offload's.
    Offload's `which=all` moves more to the host, so the prediction stays on the safe side.
    `hold=1` keeps the forward's last offloaded tensor, which the backward brings back first
    anyway, so the peak the model predicts (the backward's) stays: measured 2677 MiB with it
    against 2744 without, 3 strips at 4188 px under 4 GiB (H200, 2026-11-29,
    benchmarks/results/h200/hold-4188-4gib/)."""
    more = [f"checkpoint:{checkpoint.placement}"] if checkpoint.placement != "block" else []
    if offload.prefetch > 1:
        more.append(f"offload:prefetch={offload.prefetch}")
    if offload.hold > 1:
        more.append(f"offload:hold={offload.hold}")
    return ", ".join(more)


def check(opts: Options, plan: Plan) -> None:
    auto = opts.tiles == AUTO
    opts = concrete(opts, plan)
    # levels, keep, layer1, tiles / rows and graph_limit alone: refused by Options itself
    # (memstudy/techniques/options.py), before torch loads
    halo = min_tile_rows(opts.levels, opts.keep, opts.layer1, plan.config.model.encoder)
    if opts.rows and opts.rows < halo:
        raise ConfigError(f"tile:rows={opts.rows} is smaller than its halo of {halo} rows at "
                          f"levels={opts.levels}; use rows >= {halo}")
    height = _padded_height(plan.config.train.image_size)
    if height is not None and opts.tiles and height // opts.tiles < halo:
        raise ConfigError(f"tile:tiles={opts.tiles} makes strips of {height // opts.tiles} rows "
                          f"of the {height}-row padded image, smaller than the {halo}-row halo; "
                          f"use tiles <= {height // halo}")
    _check_composition(plan)
    _check_graphs(opts, plan)
    if opts.stream and opts.graphs:
        raise ConfigError("tile:stream=true with tile:graphs=true: a graphed tile body reads "
                          "its strips from fixed device buffers, which host boundaries do not "
                          "fill; drop one of the two")
    if opts.stream and opts.levels < 2:
        raise ConfigError("tile:stream=true with tile:levels=1: at levels=1 no boundary lies "
                          "between tiled regions and the stem reads the whole image; use "
                          "levels 2, 3 or 4 with stream")
    if opts.stream:
        check_stream_host_memory(opts, plan, auto)
    resolve_impl(opts.norm, plan.device, "tile:norm")
    if opts.levels >= 3 and plan.has("invertible"):
        tiled = "layer1" + " and layer2" * (opts.levels > 3)
        raise ConfigError(f"tile:levels={opts.levels} tiles {tiled}, whose residual blocks "
                          "invertible replaces with momentum blocks; use tile:levels=2 with "
                          "invertible, or drop invertible")


def _check_graphs(opts: Options, plan: Plan) -> None:
    if not opts.graphs:
        return
    if plan.device.type != "cuda":
        raise ConfigError(f"tile:graphs=true replays tile bodies as CUDA graphs, but train.device "
                          f"resolves to {plan.device}; set tile:graphs=false or train.device = "
                          "'cuda'")


def stream_host_bytes(opts: Options, plan: Plan) -> tuple[int, list[str]] | None:
    """Bytes of the boundaries tile:stream keeps in host memory for the run's size and batch
    (None for native sizes: known per image), and their names; from the network built on the
    meta device (no memory, no weights)."""
    import torch

    from memstudy.models import build_unet
    from memstudy.image_sizes import size_hw

    hw = size_hw(plan.config.train.image_size)
    if hw is None:
        return None
    with torch.device("meta"):
        unet = build_unet(network=plan.config.model, task=plan.config.train.task)
    tiled = TiledForward(unet, opts.levels, opts.tiles, opts.rows, opts.keep, None, opts.layer1,
                         "torch", stream=True)
    height, width = (-(-side // STRIDE) * STRIDE for side in hw)
    element = 2 if plan.has("amp") else 4  # bf16 / fp16 boundaries under amp, else float32
    return (tiled.host_bytes(height, width, plan.config.train.batch_size, element),
            sorted(tiled.host_outputs()))


def check_stream_host_memory(opts: Options, plan: Plan, auto: bool = False) -> None:
    """Refuse, before anything is built, a stream whose host boundaries and their gradients
    (in backward a host input's gradient adds up beside it: at most as much again) exceed
    this host's memory. `auto`: tile:auto chose the stream, so the fix is not to drop it."""
    from memstudy.byte_sizes import size_text
    from memstudy.image_sizes import host_memory_bytes, size_label

    sized, have = stream_host_bytes(opts, plan), host_memory_bytes()
    if sized is None or not have or 2 * sized[0] <= have:
        return
    kept, names = sized
    raise ConfigError(f"tile:stream at {size_label(plan.config.train.image_size)} px keeps "
                      f"{size_text(kept)} of boundaries in host memory ({', '.join(names)}) and "
                      f"up to as much again of their gradients in backward, "
                      f"{size_text(2 * kept)}, more than this host's {size_text(have)}; choose "
                      "a smaller size or batch, or " + (
                          "a larger budget (tile:auto streamed: no plan on the device fits)"
                          if auto else "drop tile:stream"))


def explain(opts: Options, plan: Plan) -> str | None:
    """tile:auto's pick and what stream keeps in host memory, as the plan resolves them."""
    from memstudy.byte_sizes import size_text

    lines = [auto_pick(plan).says()] if opts.tiles == AUTO else []
    actual = concrete(opts, plan)
    if actual.stream and (sized := stream_host_bytes(actual, plan)) is not None:
        lines.append(f"tile:stream keeps {size_text(sized[0])} of boundaries in host memory, "
                     "and up to as much again of their gradients in backward")
    return "\n".join(lines) or None


def _padded_height(size) -> int | None:
    """Padded rows of train.image_size when it names one height (an int or 'HxW')."""
    text = str(size)
    head = text.split("x")[0]
    if not head.isdigit():
        return None  # e.g. native sizes: checked per image when the forward plans its tiles
    return -(-int(head) // STRIDE) * STRIDE


def _check_composition(plan: Plan) -> None:
    for name, why in CONFLICTS.items():
        if plan.has(name):
            raise ConfigError(f"tile cannot compose with {name}: {why}; drop one of tile, {name}")
    for name in plan.declaring("splits_model"):  # any other technique that splits the model
        raise ConfigError(f"tile cannot compose with {name}: it splits the model, tile runs it "
                          f"whole; drop one of tile, {name}")
    if plan.has("tri_accel") and plan.chosen["tri_accel"].precision:
        raise ConfigError("tile cannot compose with tri_accel:precision, which sets autocast per "
                          "unit by wrapping the stem and decoder blocks' forward that tile runs "
                          "piecewise; use tri_accel:precision=off with tile")
    if plan.has("checkpoint") and plan.chosen["checkpoint"].placement == "sqrt":
        raise ConfigError("tile cannot compose with checkpoint:sqrt, which replaces the encoder "
                          "and decoder forward that tile runs stage by stage; use "
                          "checkpoint:block or checkpoint:selective with tile")


def apply(opts: Options, build: Build) -> None:
    picked = auto_pick(build.plan) if opts.tiles == AUTO else None
    opts = resolved(concrete(opts, build.plan))
    model = build.model
    if not hasattr(model, "forward_padded"):
        raise ConfigError("tile: the model has no forward_padded to tile; drop tile")
    kernels = resolve_impl(opts.norm, build.device, "tile:norm")
    notes = build.notes["tile"] = {"levels": opts.levels, "tiles": opts.tiles, "rows": opts.rows,
                                   "keep": opts.keep, "layer1": opts.layer1, "norm": kernels,
                                   "stream": opts.stream, "ahead": opts.ahead,
                                   "halo_rows": min_tile_rows(opts.levels, opts.keep, opts.layer1,
                                                              build.config.model.encoder)}
    if picked is not None:
        notes["auto"], notes["says"] = picked.record(), picked.says()
    if opts.stream and (sized := stream_host_bytes(opts, build.plan)) is not None:
        notes["stream_host_bytes"] = sized[0]
    build.runtime.inputs_on_host = opts.stream  # the image's strips and the target's blocks
    if opts.stream:
        TRAFFIC.take()  # the run's own copies from here
        build.runtime.series_sources.append(lambda: _traffic_rows(build.runtime.rank))
    graphs = None
    if opts.graphs:
        graphs = TileGraphs(CudaGraphs(), opts.graph_limit, opts.graph_fallback, notes)
        build.runtime.series_sources.append(lambda: _graph_rows(graphs, build.runtime.rank))
    model.forward_padded = TiledForward(model, opts.levels, opts.tiles, opts.rows, opts.keep,
                                        graphs, opts.layer1, kernels, opts.stream, opts.ahead)


def folded_levels(opts: Options) -> int:
    """Decoder levels that never call nearest up-sampling: the tiled ones (their up-convolution
    is folded), and with `stream` every one (TiledForward folds the untiled blocks too)."""
    return NETWORK_LEVELS - 1 if opts.stream else opts.levels


def _traffic_rows(rank: int) -> list[tuple[int, int, str, float]]:
    """The run's streamed copies (series step 0, run totals): bytes each way."""
    h2d, d2h = TRAFFIC.take()
    return [(rank, 0, "stream_h2d_bytes", float(h2d)), (rank, 0, "stream_d2h_bytes", float(d2h))]


def _graph_rows(graphs: TileGraphs, rank: int) -> list[tuple[int, int, str, float]]:
    """The run's graph counts (series step 0): graphs captured, tiles run eagerly past the limit."""
    return [(rank, 0, f"tile_{name}", float(graphs.record[name]))
            for name in ("graphs_captured", "eager_tiles")]


register(Technique("tile", Stage.ACTIVATION, Options,
                   "exact row-strip tiling of the top U-Net levels (BatchNorm statistics of the "
                   "whole image): boundaries only in memory, tiles recomputed in backward",
                   apply, check, folded_upsampling_levels=folded_levels, resolve=concrete,
                   explain=explain,
                   needs_unet="tiles the U-Net's stem, residual blocks and decoder blocks"))
