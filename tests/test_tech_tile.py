"""The `tile` technique through the registry: refusals by name, composition with checkpoint
(float64, exact) and amp:bf16 + checkpoint (a measured step), and the memory it saves (tensors
saved for backward; the tensor meter's peak of the tiled levels against the tile count).

Exactness of the tiling itself is tests/test_tiling.py.
"""
from __future__ import annotations

import pytest
import torch
from conftest import small_config
from helpers import measured_step, saved_bytes

from memstudy.errors import ConfigError
from memstudy.meters.tensor import LiveTensorMeter
from memstudy.models import build_unet
from memstudy.techniques.compose import build_pipeline, make_plan
from memstudy.tiling.tiled_forward import TiledForward
from memstudy.tiling.sweep import run_region


@pytest.mark.parametrize("techniques, named", [
    (["tile:rows=4"], "tile:rows=4 is smaller than its halo of 8 rows"),
    (["tile:rows=8:keep=none"], "tile:rows=8 is smaller than its halo of 12 rows"),
    (["tile:rows=30"], "tile:rows=30 must be a multiple of 4"),
    (["tile:levels=5"], "tile:levels=5 is not implemented"),
    (["tile:keep=most"], "tile:keep='most' is not a kept-boundary choice"),
    (["tile:levels=3:rows=24"], "tile:rows=24 is smaller than its halo of 32 rows"),
    (["tile:layer1=blocks"], "tile:layer1=blocks cuts layer1, which only levels 3 and 4 tile"),
    (["tile:levels=3:layer1=rows"], "layer1='rows' is not one of"),
    (["tile:levels=3", "invertible"], "tile:levels=3 tiles layer1"),
    (["tile:levels=4", "invertible"], "tile:levels=4 tiles layer1 and layer2"),
    (["tile:levels=0"], "tile:levels=0"),
    (["tile:levels=7"], "tile:levels=7"),
    (["tile:40"], "tile:tiles=40"),
    (["tile:2:rows=64"], "give tiles (2) or rows (64), not both"),
    (["tile:levels=1:stream=true"], "tile:stream=true with tile:levels=1"),
    (["tile:levels=3:ahead=true"], "tile:ahead=true without tile:stream=true"),
    (["tile", "checkpoint:sqrt"], "checkpoint:sqrt"),
    (["tile", "quantization"], "tile cannot compose with quantization"),
])
def test_bad_options_refused_by_name(techniques, named):
    with pytest.raises(ConfigError) as err:
        make_plan(small_config(techniques=techniques))
    assert named in str(err.value)


def test_val_tile_rows_checked():
    cfg = small_config(val_tile_rows=30)
    with pytest.raises(ConfigError, match="train.val_tile_rows = 30"):
        make_plan(cfg)


TILE = "tile:tiles=0:rows=0:levels=2:keep=conv1:graphs=False:graph_limit=256:graph_fallback=False"


@pytest.mark.parametrize("spec, form, digest", [
    ("tile", TILE, "481a4b32e1d89b18"),
    ("tile:norm=auto:layer1=whole", TILE, "481a4b32e1d89b18"),  # the defaults: left out
    ("tile:norm=torch", TILE + ":norm=torch", "eed3052961b507ee"),
    ("tile:stream=false", TILE, "481a4b32e1d89b18"),  # stream came later: its default left out
    # ahead came later and its default changed since: its value then (false, the copies on
    # the compute stream) left out; true (now the default where streamed) written
    ("tile:stream=true:ahead=false", TILE + ":stream=True", "1bb60e9b01b1eafe"),
    ("tile:stream=true", TILE + ":stream=True:ahead=True", "5f966bfb038a60bc"),
    ("tile:stream=true:ahead=true", TILE + ":stream=True:ahead=True", "5f966bfb038a60bc"),
    # plans came later: tile:auto's runs before it picked among set 1, which is left out
    ("tile:auto", TILE.replace("tiles=0", "tiles=auto") + ":ahead=True:plans=2",
     "18feabbe3241d9bf"),
    ("tile:auto:plans=1", TILE.replace("tiles=0", "tiles=auto") + ":ahead=True",
     "89195f03dc90889a"),
    ("tile:levels=3:layer1=blocks:norm=triton",
     TILE.replace("levels=2", "levels=3") + ":norm=triton:layer1=blocks", "679d056f54a0d8ca"),
])
def test_canonical_form_and_hash_are_pinned(spec, form, digest):
    """Tile runs are recorded under this form and hash (4188 px, batch 1, CUDA). norm, layer1,
    stream and ahead came after runs were recorded (hash_neutral): at the values those runs had
    they are left out,
    so those runs keep their hashes; set otherwise they are written (another run). A change that
    alters these makes every database rerun its tile runs: raise config.HASH_SCHEMA on purpose
    and renew the values."""
    from memstudy.config import RunConfig
    from memstudy.grid import config_hash
    from memstudy.techniques import canonical

    assert canonical([spec]) == [form]
    cfg = RunConfig(techniques=[spec])
    cfg.train.device, cfg.train.image_size, cfg.train.batch_size = "cuda", 4188, 1
    assert config_hash(cfg) == digest


def _global_error(got: dict, ref: dict) -> float:
    diff = torch.cat([(got[n].double() - ref[n].double()).flatten() for n in ref])
    return (diff.norm() / torch.cat([r.double().flatten() for r in ref.values()]).norm()).item()


def float64_pipeline_step(techniques: list[str]) -> dict[str, torch.Tensor]:
    """One forward + backward of the composed pipeline (registry, compose order, the runtime's
    forward context) with the model in float64 and a float64 loss, so composition is checked
    to float64 rounding."""
    build = build_pipeline(make_plan(small_config(techniques=techniques)))
    model, rt = build.model.double(), build.runtime
    gen = torch.Generator().manual_seed(7)
    x = torch.rand(1, 1, 192, 192, generator=gen, dtype=torch.float64)
    with rt.forward_context():
        out = model(x)
    loss = (out - x).square().mean()
    loss.backward()
    result = {f"grad:{n}": p.grad for n, p in model.named_parameters()}
    result.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    return {"out": out.detach(), "loss": loss.detach(), **result}


@pytest.mark.parametrize("tile, others", [
    ("tile:3", ["checkpoint"]),
    # bench_ladder.SELECTIVE_SET's composition: the convolutions kept, nothing else recomputed
    ("tile:3:keep=all", ["checkpoint:selective"]),
])
def test_composes_with_checkpoint_exactly(tile, others):
    plain = float64_pipeline_step(others)
    tiled = float64_pipeline_step([tile, *others])
    for name, ref in plain.items():
        error = ((tiled[name] - ref).double().norm() / ref.double().norm().clamp_min(1e-300))
        assert error < 1e-6, f"{name}: relative error {error:.3g}"


def test_composes_with_amp_bf16_and_checkpoint():
    """bf16 rounds differently in the two runs (tile normalises in float32 from whole-image
    statistics, the plain model's BatchNorm from its own), so the tiled bf16 step is compared
    with float32: no further from it than 3x the plain bf16 step is (gradients, all together)."""
    exact = measured_step(["checkpoint"], optimizer_step=True)
    plain = measured_step(["amp:bf16", "checkpoint"], optimizer_step=True)
    tiled = measured_step(["tile:3", "amp:bf16", "checkpoint"], optimizer_step=True)
    assert _global_error(tiled.grads, exact.grads) <= 3 * _global_error(plain.grads, exact.grads)
    assert abs(tiled.loss - exact.loss) <= 3 * abs(plain.loss - exact.loss) + 1e-6
    counts = [n for n in plain.buffers if n.endswith("num_batches_tracked")]
    assert counts and all(torch.equal(tiled.buffers[n], plain.buffers[n]) for n in counts)
    # what the forward keeps for backward: the tiled levels keep only their boundaries
    assert tiled.forward["saved_bytes"] < plain.forward["saved_bytes"]
    assert tiled.notes["tile"]["tiles"] == 3


def test_saved_bytes_are_the_boundaries():
    """Untiled, the top levels save their full- and half-resolution activations; tiled, only the
    input, the 1/4-res stem output and decoder block 2's output are saved there, whatever the
    tile count (measured 96.8 MB untiled, 44.1 MB tiled at 256 px)."""
    x = torch.rand(1, 1, 256, 256)
    plain = saved_bytes(build_unet(seed=0), x)
    tiled = {}
    for tiles in (2, 4):
        model = build_unet(seed=0)
        model.forward_padded = TiledForward(model, 2, tiles=tiles)
        tiled[tiles] = saved_bytes(model, x)
    assert tiled[2] == tiled[4]
    # one float32 full-resolution 16-channel map is 4 MiB at 256 px; untiled keeps many of them
    full_res_map = 16 * 256 * 256 * 4
    assert plain - tiled[4] > 8 * full_res_map


def test_peak_of_tiled_levels_falls_with_the_tile_count():
    """Tensor meter over the two tiled regions' forward + backward (stem and top, as the
    forward runs them): one tile holds the whole top levels' activations while it recomputes
    them, eight hold an eighth (measured 61 / 38 / 25 / 17 MB for 1 / 2 / 4 / 8 tiles)."""
    x = torch.rand(1, 1, 256, 256)
    d2 = torch.rand(1, 64, 64, 64, requires_grad=True)  # decoder block 2's output (1/4 res)
    peaks = {}
    for tiles in (1, 2, 4, 8):
        tiled = TiledForward(build_unet(seed=0), 2, tiles=tiles, keep="none")
        plan = tiled.plan(256)
        with LiveTensorMeter() as meter:
            pooled, stats, _ = run_region(tiled.regions["stem"], plan["stem"], [x])
            out, _, _ = run_region(tiled.regions["top"], plan["top"], [d2, x], stats[:1])
            (out.sum() + pooled.sum()).backward()
        peaks[tiles] = meter.peak
    assert peaks[1] > peaks[2] > peaks[4] > peaks[8], peaks
    assert peaks[8] < peaks[1] / 3, peaks


def _cuda_step(size: int, dtype: torch.dtype, layout: dict | None, warmup: bool = False,
               batch: int = 1):
    """Gradients and allocator peak of one forward + backward on CUDA (channels_last), after
    one untimed step if `warmup` (cudnn.benchmark's trials allocate workspaces of their own)."""
    x = torch.rand(batch, 1, size, size, device="cuda", dtype=dtype,
                   generator=torch.Generator("cuda").manual_seed(0))
    model = build_unet(seed=0).cuda().to(dtype).to(memory_format=torch.channels_last)
    if layout:
        model.forward_padded = TiledForward(model, **layout)
    if warmup:
        model(x.to(memory_format=torch.channels_last)).square().mean().backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    model(x.to(memory_format=torch.channels_last)).square().mean().backward()
    torch.cuda.synchronize()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return grads, torch.cuda.max_memory_allocated() - start


@pytest.mark.gpu
@pytest.mark.parametrize("layout, batch", [({"levels": 2, "tiles": 4}, 1),
                                           ({"levels": 2, "tiles": 3, "keep": "conv1"}, 1),
                                           ({"levels": 3, "tiles": 2}, 1),
                                           ({"levels": 2, "tiles": 3, "keep": "all"}, 2)])
def test_gpu_tiled_gradients_exact_in_float64(layout, batch):
    """On CUDA with cuDNN and the SyncBatchNorm primitives of tiling/norm.py, in float64 (float32
    differences are rounding noise of deep BatchNorm sums, ~1e-2 per tensor, tiled or not): the
    tiled step's gradients equal the untiled step's to relative 1e-9 over all parameters. Batch
    2 makes the strips of kept boundaries strided (not dense in either memory format)."""
    tiled, _ = _cuda_step(256, torch.float64, layout, batch=batch)
    plain, _ = _cuda_step(256, torch.float64, None, batch=batch)
    assert _global_error(tiled, plain) < 1e-9


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_tiled_step_lowers_the_peak():
    """At 1024 px under bf16 autocast with cudnn.benchmark on (as memstudy's tuned runs), the
    tiled step's allocator peak is under 3/4 of the untiled one's (H100 at 4188 px: 0.53-0.55;
    the untiled lower levels hold the rest). Not in float32 with benchmark off: there cuDNN's
    heuristics took a 26.8 GB workspace for a strip convolution at 1024 px on the H100, which
    measures cuDNN's appetite for free memory, not tiling."""
    torch.backends.cudnn.benchmark = True
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, tiled = _cuda_step(1024, torch.float32, {"levels": 2, "tiles": 8}, warmup=True)
            _, plain = _cuda_step(1024, torch.float32, None, warmup=True)
    finally:
        torch.backends.cudnn.benchmark = False
    assert tiled < 0.75 * plain, (tiled, plain)


def test_offload_hooks_see_the_boundaries_and_keep_gradients():
    """What offload / compression act on: the tensors tile's Functions save go through the
    saved-tensor hooks (here offload's own pack / unpack, host = compute = cpu), and the
    gradients are unchanged by the round trip. The input image is saved by nothing but tile's
    Functions (the stem is tiled), so seeing it packed shows they use the hooks."""
    from memstudy.techniques.offload import Offloader

    x = torch.rand(1, 1, 192, 192)  # a multiple of 32: the model's padding returns x itself
    grads, packed = [], set()
    for hooks in (False, True):
        model = build_unet(seed=0)
        model.forward_padded = TiledForward(model, 2, tiles=3)
        offloader = Offloader(torch.device("cpu"))

        def pack(t):
            packed.add(t.untyped_storage().data_ptr())
            return offloader.pack(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, offloader.unpack) if hooks \
                else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = model(x).square().mean()
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert x.untyped_storage().data_ptr() in packed
    assert offloader.offloaded_bytes >= x.nbytes
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@pytest.mark.parametrize("keep, calls", [("none", 2 * 5 * 2), ("conv1", 2 * 1 * 2)])
def test_keep_conv1_runs_block3_conv1_once_per_sweep(keep, calls, monkeypatch):
    """Decoder block 3's first convolution (the tiled levels' costliest) per training step with 2
    tiles: in region "top" (keep=none) every one of its 5 sweeps (4 statistics + 1 apply) runs it
    per tile, in forward and again in backward; with keep=conv1 its own region has no BatchNorm
    of its own, so one sweep forward and one in backward. (The tile bodies run it as
    TensorOps.up_conv, folded with the up-sampling, not through the module.)"""
    from memstudy.tiling import tiled_forward as unet

    seen = []
    up_conv = unet.TensorOps.up_conv
    monkeypatch.setattr(unet.TensorOps, "up_conv",
                        lambda self, name, *a: seen.append(name) or up_conv(self, name, *a))
    model = build_unet(seed=0)
    model.forward_padded = TiledForward(model, 2, tiles=2, keep=keep)
    model(torch.rand(1, 1, 128, 128)).square().mean().backward()
    assert seen.count("block3.conv1") == calls


@pytest.mark.parametrize("keep, own_norms", [
    ("conv1", {"stem": 1, "block3.conv1": 0, "top": 3}),
    ("all", {"stem": 1, "block3.conv1": 0, "block4.conv1": 1, "top": 1}),
    ("bn", {"stem.conv1": 0, "stem": 0, "block3.conv1": 0, "block3.conv2": 0, "block4.conv1": 0,
            "block4.conv2": 0, "top": 0}),
    ("half", {"stem.conv1": 0, "stem": 0, "block3.conv1": 0, "block3.conv2": 0,
              "block4.conv1": 0, "top": 1})])
def test_statistics_of_a_kept_tensor_come_from_the_region_that_writes_it(keep, own_norms):
    """A region that stops before a BatchNorm returns its statistics from the sweep that writes
    its output, so the next region computes no statistics sweep for it: a region's own
    BatchNorms (K, which cost K + 1 sweeps each way) are those inside it only. With keep=bn
    every region runs one sweep forward and one backward."""
    tiled = TiledForward(build_unet(seed=0), 2, tiles=2, keep=keep)
    assert {name: len(r.norms) - r.shared for name, r in tiled.regions.items()} == own_norms


def test_keep_bn_runs_every_tiled_convolution_once_per_tile_each_way(monkeypatch):
    """keep=bn: each tiled decoder convolution runs once per tile in forward and once in
    backward's recomputation (2 tiles: 4 calls), the stem's in its own region and again for
    block 3's skip (8; keep=all runs it in the stem's 2 sweeps and block 3's 1, each way: 12).
    The blocks' first convolutions run as TensorOps.up_conv (folded with the up-sampling)."""
    from memstudy.tiling import tiled_forward as unet

    up_conv = unet.TensorOps.up_conv

    def counted(self, name, *args):
        seen[name] += 1
        return up_conv(self, name, *args)

    monkeypatch.setattr(unet.TensorOps, "up_conv", counted)
    counts = {}
    for keep in ("bn", "all"):
        model = build_unet(seed=0)
        model.forward_padded = TiledForward(model, 2, tiles=2, keep=keep)
        convs = {"conv1": model.encoder.conv1, "head": model.head[0]}
        convs.update({f"block{i}.conv{k}": getattr(model.decoder_blocks[i], f"conv{k}")[0]
                      for i in (3, 4) for k in (1, 2)})
        seen = {name: 0 for name in convs}
        for name, conv in convs.items():
            conv.register_forward_hook(lambda *_, name=name: seen.__setitem__(name, seen[name] + 1))
        model(torch.rand(1, 1, 128, 128)).square().mean().backward()
        counts[keep] = seen
    assert counts["bn"].pop("conv1") == 8 and set(counts["bn"].values()) == {4}, counts["bn"]
    assert counts["all"]["conv1"] == 12 and counts["all"]["block4.conv2"] == 8, counts["all"]


@pytest.mark.parametrize("keep", ["all", "half", "bn"])
def test_boundary_offload_moves_every_region_input(keep):
    """offload:which=boundaries moves what tile keeps between regions, not only checkpoint's
    region inputs: with keep=all and no checkpoint, the image and every kept first-convolution
    output (block 3's at half and block 4's at full resolution) cross to the host, once each,
    and the gradients are those of the run without offload; keep=bn also moves the stem's
    convolution output and each block's second convolution output."""
    from memstudy.techniques.offload import Offloader

    x = torch.rand(1, 1, 128, 128)
    grads, offloaders = [], []
    for boundaries_only in (None, True):
        model = build_unet(seed=0)
        model.forward_padded = TiledForward(model, 2, tiles=2, keep=keep)
        off = Offloader(torch.device("cpu"), min_bytes=0, boundaries_only=bool(boundaries_only))
        pack, unpack = (off.pack, off.unpack) if boundaries_only else (lambda t: t, lambda t: t)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = model(x).square().mean()
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        offloaders.append(off)
    z3, z4 = 32 * 64 * 64 * 4, 16 * 128 * 128 * 4  # 32 ch at half, 16 ch at full resolution
    # the image, z3, z4 and the decoder's block-3 input (64 ch, 1/4 res) each once
    want = x.nbytes + z3 + z4 + 64 * 32 * 32 * 4
    if keep in ("half", "bn"):  # the stem's output (64 ch at half resolution) and y3 too
        want += 64 * 64 * 64 * 4 + z3
    if keep == "bn":  # and y4
        want += z4
    assert offloaders[1].offloaded_bytes == want, (offloaders[1].offloaded_bytes, want)
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_early_copies_start_as_each_region_begins_and_change_nothing_else():
    """offload:early: each tile region's inputs start their copy to the host as the region
    begins (the watcher sees them before any save: the copy has no use yet), and the saves
    after the sweeps take those copies. The same bytes cross, each tensor once, hold=1 keeps
    the same last input, the prefetch window serves the same uses, the gradients are those
    without early; a forward without grad (validation) copies nothing."""
    import contextlib

    from memstudy.runtime import watching_boundaries
    from memstudy.techniques.offload import Offloader

    x = torch.rand(1, 1, 128, 128)
    runs = {}
    for early in (False, True):
        model = build_unet(seed=0)
        model.forward_padded = TiledForward(model, 2, tiles=2, keep="all")
        off = Offloader(torch.device("cpu"), min_bytes=0, boundaries_only=True, prefetch=1,
                        hold=1)
        uses_at_copy = []
        copy_to_host = off._copy_to_host
        off._copy_to_host = lambda t, **kw: uses_at_copy.append(kw["uses"]) or copy_to_host(t, **kw)
        for _ in range(2):  # the second step is a new forward: copies numbered afresh
            model.zero_grad(set_to_none=True)
            watch = watching_boundaries(off.early) if early else contextlib.nullcontext()
            with watch, torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack):
                loss = model(x).square().mean()
            loss.backward()
        runs[early] = (off, uses_at_copy, {n: p.grad for n, p in model.named_parameters()})
    (plain, plain_uses, plain_grads), (off, uses, grads) = runs[False], runs[True]
    assert len(uses) == len(plain_uses) > 0 and set(plain_uses) == {1} and set(uses) == {0}
    assert off.early_copies == len(uses) and off.stats["early"] == len(uses)
    assert plain.early_copies == 0  # copies made at a save are not early ones
    assert off.offloaded_bytes == plain.offloaded_bytes
    assert off.held_bytes == plain.held_bytes > 0  # hold=1 keeps the same last input
    window = ("prefetched", "on_demand", "reused")
    assert [off.stats[k] for k in window] == [plain.stats[k] for k in window]
    assert all(torch.equal(plain_grads[n], grads[n]) for n in grads)
    with torch.no_grad(), watching_boundaries(off.early):
        model(x)
    assert off.early_copies == len(uses)


@pytest.mark.parametrize("change, refusal", [
    ({"padding_mode": "reflect"}, "block4.conv1 is not a 3x3 / stride 1 / zero padding 1"),
    ({"groups": 2}, "block4.conv1 is a grouped convolution")])
def test_a_decoder_convolution_the_walks_do_not_reproduce_is_refused(change, refusal):
    """The strips' halos and the folded up-convolution assume zero padding and one group."""
    model = build_unet(seed=0)
    conv = model.decoder_blocks[4].conv1[0]
    for name, value in change.items():
        setattr(conv, name, value)
    with pytest.raises(ConfigError, match=refusal):
        TiledForward(model, 2, tiles=2)


@pytest.mark.parametrize("layer1", ["convs", "blocks"])
def test_each_region_input_comes_back_once_per_backward(layer1):
    """A region's Functions (its statistics sweeps and its apply) all read the region's inputs
    in backward; a transform (offload here) must bring each input back once per region, not
    once per Function. levels=3 cuts layer1 into regions with two inputs (a block's residual and
    its convolution's output), where at most one held copy made the two evict each other: at
    8192 px each layer1 input crossed PCIe twice (H100, 2026-11-27). Only the image comes back
    twice: the first region (stem) and the last (top, its residual) save it, uses at both ends
    of backward. Gradients unchanged (float64, bitwise)."""
    import collections

    from memstudy.techniques.offload import Offloader

    x = torch.rand(1, 1, 128, 128, dtype=torch.float64)
    grads, back = [], collections.Counter()
    for hooked in (False, True):
        model = build_unet(seed=0).double()
        model.forward_padded = TiledForward(model, 3, tiles=2, keep="conv1", layer1=layer1)
        off = Offloader(torch.device("cpu"), min_bytes=0, boundaries_only=True)
        copy_back = off._copy_back

        def counted(host, device, event):
            back[(id(host), tuple(host.shape))] += 1
            return copy_back(host, device, event)

        off._copy_back = counted
        pack, unpack = (off.pack, off.unpack) if hooked else (lambda t: t, lambda t: t)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = model(x).square().mean()
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    twice = [shape for (_, shape), n in back.items() if n > 1]
    assert len(back) >= 7 and twice == [tuple(x.shape)], back
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_stream_with_graphs_is_refused_in_one_line():
    cfg = small_config(techniques=["tile:stream=true:graphs=true"])
    cfg.train.device = "cuda"
    with pytest.raises(ConfigError, match="tile:stream=true with tile:graphs=true"):
        make_plan(cfg, device=torch.device("cuda"), n_gpus=1)


def test_stream_sizes_its_host_memory_and_refuses_what_the_host_lacks(monkeypatch):
    """tile:stream's host boundaries for ResNet-34 at levels=3, layer1=convs, 1024 px, float32:
    p0, a0, p1, a1, p2, a2 and z2 (64 x 256 x 256) and z3 (32 x 512 x 512), 4 bytes each:
    144 MiB; twice that with their gradients must fit the host, or the plan is refused."""
    from memstudy import image_sizes
    from memstudy.techniques.tile import stream_host_bytes

    spec = "tile:3:levels=3:layer1=convs:stream=true"
    plan = make_plan(small_config(1024, techniques=[spec]))
    kept, names = stream_host_bytes(plan.chosen["tile"], plan)
    assert (kept, names) == (144 * 2**20, ["a0", "a1", "a2", "p0", "p1", "p2", "z2", "z3"])
    monkeypatch.setattr(image_sizes, "host_memory_bytes", lambda: 200 * 2**20)
    with pytest.raises(ConfigError, match=r"tile:stream at 1024 px keeps 144MiB of boundaries "
                                          r"in host memory \(a0, .*z3\) .* 288MiB, more than "
                                          r"this host's 200MiB"):
        make_plan(small_config(1024, techniques=[spec]))
    monkeypatch.setattr(image_sizes, "host_memory_bytes", lambda: 288 * 2**20)
    make_plan(small_config(1024, techniques=[spec]))
