"""Exactness of the tiled U-Net (memstudy/tiling): a training step and an eval forward of the
tiled model equal the untiled model's.

Compared after one forward, backward and SGD step on the same weights and batch: output, loss,
every parameter gradient, the input gradient, every parameter after the step, and the
BatchNorm running statistics and num_batches_tracked. Float64 with relative tolerance 1e-10
(measured differences are ~1e-13: rounding of a different summation order), float32 with 1e-4.
Relative error of a tensor = ||tiled - untiled|| / ||untiled||.
"""
from __future__ import annotations

import functools

import pytest
import torch

from memstudy.models import build_unet
from memstudy.network import ModelConfig
from memstudy.tiling.tiled_forward import TiledForward
from memstudy.errors import ConfigError
from memstudy.tiling.geometry import split_rows
from memstudy.tiling.graphs import Emulated, TileGraphs
from memstudy.tiling.validation import validation_forward

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def _batch(height: int, width: int, dtype: torch.dtype, batch: int = 1):
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(batch, 1, height, width, generator=gen, dtype=dtype)
    y = torch.rand(batch, 1, height, width, generator=gen, dtype=dtype)
    return x, y


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # rows and columns weighted differently, so every output pixel has its own gradient
    h, w = out.shape[-2:]
    weight = torch.outer(torch.linspace(0.5, 1.5, h, dtype=out.dtype),
                         torch.linspace(1.5, 0.5, w, dtype=out.dtype))
    return ((out - y) ** 2 * weight).mean()


def train_step(height: int, width: int, dtype: torch.dtype, tiling: dict | None, batch: int = 1,
               encoder: str = "resnet34", classes: int = 1):
    """One step; returns everything the comparison checks, as plain tensors. classes > 1: the
    segmentation network (per-pixel class logits, no sigmoid)."""
    network = ModelConfig(encoder=encoder, classes=classes)
    model = build_unet(seed=0, network=network, task="segment" if classes > 1 else "enhance")
    model = model.to(dtype).train()
    if tiling is not None:
        model.forward_padded = TiledForward(model, **tiling)
    x, y = _batch(height, width, dtype, batch)
    x.requires_grad_(True)
    out = model(x)
    loss = _loss(out, y)
    loss.backward()
    result = {"out": out.detach(), "loss": loss.detach(), "x.grad": x.grad}
    result.update({f"grad:{n}": p.grad.clone() for n, p in model.named_parameters()})
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    result.update({f"param:{n}": p.detach().clone() for n, p in model.named_parameters()})
    result.update({f"buffer:{n}": b.clone() for n, b in model.named_buffers()})
    return result


@functools.lru_cache(maxsize=4)
def untiled_step(height: int, width: int, dtype: torch.dtype, batch: int = 1):
    return train_step(height, width, dtype, None, batch)


def relative_errors(tiled: dict, plain: dict) -> dict[str, float]:
    assert tiled.keys() == plain.keys()
    errors = {}
    for name, ref in plain.items():
        ref, got = ref.double(), tiled[name].double()
        errors[name] = ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()
    return errors


def assert_exact(tiled: dict, plain: dict, tol: float) -> None:
    errors = relative_errors(tiled, plain)
    worst = max(errors, key=errors.get)
    assert errors[worst] < tol, f"{worst}: relative error {errors[worst]:.3g} >= {tol}"
    counts = [n for n in plain if n.endswith("num_batches_tracked")]
    assert counts and all(torch.equal(tiled[n], plain[n]) for n in counts)


@pytest.mark.parametrize("height, width, tiling, batch", [
    (256, 256, {"levels": 2, "tiles": 3}, 1),  # 64 quarter-res rows: uneven 21 / 21 / 22
    (270, 200, {"levels": 2, "rows": 80}, 2),  # padded to 288 x 224; strips of 80, 80, 80, 48
    (256, 256, {"levels": 1, "tiles": 5}, 1),  # full resolution only: 128 half-res rows / 5
    (256, 256, {"levels": 2, "tiles": 3, "keep": "conv1"}, 1),  # block 3's conv1 output kept
    (128, 160, {"levels": 3, "tiles": 3}, 1),  # layer1 and block 2 too: 16 1/8-res rows / 3
    (192, 160, {"levels": 3, "rows": 64, "keep": "conv1"}, 1),  # blocks 2 and 3 conv1 kept
    (128, 160, {"levels": 2, "tiles": 3, "keep": "all"}, 1),  # blocks 3 and 4 conv1 kept
    (128, 160, {"levels": 2, "tiles": 3, "keep": "bn"}, 1),  # every BatchNorm input kept
    (128, 160, {"levels": 2, "tiles": 3, "keep": "half"}, 2),  # ... but block 4's conv2 output
    (128, 160, {"levels": 3, "tiles": 3, "keep": "bn"}, 2),  # ... and layer1's sweeps
    (128, 160, {"levels": 3, "tiles": 3, "layer1": "blocks"}, 2),  # a region per BasicBlock
    # + a<j> kept; tile:stream: the boundaries only tiled regions read in host memory
    (128, 160, {"levels": 3, "tiles": 5, "keep": "all", "layer1": "convs", "stream": True}, 1),
    # layer2 and decoder block 1 too (1/16-res coarse rows: 12 in 3 tiles), in one region
    (192, 96, {"levels": 4, "tiles": 3}, 2),
    # every block of layer1 and layer2 cut at its input and first convolution, uneven strips of
    # 5 coarse rows and the last of 1, host boundaries
    (256, 96, {"levels": 4, "rows": 80, "layer1": "convs", "stream": True}, 1),
    # tile:auto's streamed plan (plan set 2): cut at the blocks, the conv1 outputs kept
    (256, 96, {"levels": 4, "rows": 80, "keep": "conv1", "layer1": "blocks", "stream": True}, 1),
], ids=["levels2-3tiles", "levels2-rows80-odd-size-batch2", "levels1-5tiles",
        "levels2-keep-conv1", "levels3-3tiles", "levels3-rows64-keep-conv1", "levels2-keep-all",
        "levels2-keep-bn", "levels2-keep-half-batch2", "levels3-keep-bn-batch2",
        "levels3-layer1-blocks-batch2",
        "levels3-layer1-convs-5tiles-stream", "levels4-3tiles-batch2",
        "levels4-layer1-convs-rows80-stream", "levels4-layer1-blocks-rows80-stream"])
def test_tiled_step_equals_untiled_float64(height, width, tiling, batch):
    plain = untiled_step(height, width, torch.float64, batch)
    assert_exact(train_step(height, width, torch.float64, tiling, batch), plain,
                 TOL[torch.float64])


# Every block kind the walk knows: BasicBlocks (2 in ResNet-18's layer1), Bottlenecks with the
# projection shortcut in block 0 (ResNet-50), grouped 3x3 convolutions (ResNeXt). Rectangular,
# batch 2, strips of uneven height (16 1/8-res rows in 3 tiles: 5 / 6 / 5).
ENCODERS = ("resnet18", "resnet50", "resnext50_32x4d")


@pytest.mark.parametrize("encoder", ENCODERS)
def test_tiled_step_equals_untiled_float64_every_encoder(encoder):
    """Each way of cutting layer1 (in one region with the stem, a region per block, also cut at
    each block's first convolution) against one untiled step (not cached: three encoders'
    float64 steps would crowd out the ResNet-34 ones the other tests share)."""
    plain = train_step(128, 96, torch.float64, None, 2, encoder)
    for layer1 in ("whole", "blocks", "convs"):
        tiling = {"levels": 3, "tiles": 3, "keep": "conv1", "layer1": layer1}
        assert_exact(train_step(128, 96, torch.float64, tiling, 2, encoder), plain,
                     TOL[torch.float64])


@pytest.mark.parametrize("encoder", ["resnet50", "resnext50_32x4d"])
def test_tiled_step_equals_untiled_float64_levels4_bottlenecks(encoder):
    """levels=4 walks layer2, whose block 0 strides in its 3x3 convolution (a Bottleneck's
    second, grouped in ResNeXt) and in its projection: rectangular, batch 2, 8 coarse rows in
    3 strips; the stages cut at each block's first convolution and at the blocks (tile:auto's
    streamed plans)."""
    plain = train_step(128, 64, torch.float64, None, 2, encoder)
    for layer1 in ("convs", "blocks"):
        tiling = {"levels": 4, "tiles": 3, "keep": "conv1", "layer1": layer1}
        assert_exact(train_step(128, 64, torch.float64, tiling, 2, encoder), plain,
                     TOL[torch.float64])


def test_tiled_segmentation_step_equals_untiled_float64():
    """The segmentation head: three channels of logits, no sigmoid."""
    plain = train_step(96, 128, torch.float64, None, 2, "resnet18", classes=3)
    tiled = train_step(96, 128, torch.float64, {"levels": 3, "tiles": 3, "layer1": "blocks"}, 2,
                       "resnet18", classes=3)
    assert plain["out"].shape[1] == 3 and plain["out"].min() < 0  # logits, not a sigmoid
    assert_exact(tiled, plain, TOL[torch.float64])


@pytest.mark.parametrize("encoder", ["resnet50", "resnext50_32x4d"])
def test_tiled_step_equals_untiled_float64_levels2_every_encoder(encoder):
    """levels=2 never walks layer1: only the encoder's channel counts change what it tiles."""
    plain = train_step(96, 128, torch.float64, None, 2, encoder)
    assert_exact(train_step(96, 128, torch.float64, {"levels": 2, "rows": 28}, 2, encoder),
                 plain, TOL[torch.float64])


@pytest.mark.parametrize("height, width, tiling, batch", [
    (270, 200, {"levels": 2, "rows": 80}, 2),
    (128, 160, {"levels": 3, "tiles": 3}, 1),
    (128, 160, {"levels": 2, "tiles": 3, "keep": "all"}, 1),
    (128, 160, {"levels": 2, "tiles": 3, "keep": "bn"}, 1),
    (128, 160, {"levels": 2, "tiles": 3, "keep": "half"}, 1),
    (128, 160, {"levels": 3, "tiles": 3, "layer1": "convs"}, 1),
], ids=["levels2-rows80-odd-size-batch2", "levels3-3tiles", "levels2-keep-all", "levels2-keep-bn",
        "levels2-keep-half", "levels3-layer1-convs"])
def test_graphed_tiles_equal_untiled_float64(height, width, tiling, batch):
    """tile:graphs: the tile bodies replayed from captures (emulated on the CPU: each replay
    reads only the staging buffers, as a CUDA graph does) give the untiled step's values."""
    graphs = TileGraphs(Emulated())
    got = train_step(height, width, torch.float64, {**tiling, "graphs": graphs}, batch)
    assert_exact(got, untiled_step(height, width, torch.float64, batch), TOL[torch.float64])
    assert graphs.record["graphs_captured"] > 0 and graphs.record["eager_tiles"] == 0


def test_equal_strips_share_a_graph():
    """16 tiles of one plan capture a few geometries per sweep (first, middle, last), not 16:
    the host cost of a step no longer grows with the tile count. levels=1, keep=none: one region
    with 2 BatchNorms, 3 forward and 3 backward sweeps; 128 half-res rows in 16 equal strips."""
    graphs = TileGraphs(Emulated())
    train_step(256, 128, torch.float64, {"levels": 1, "tiles": 16, "graphs": graphs})
    assert graphs.record["graphs_captured"] == 6 * 3, graphs.record


def test_graph_limit_stops_or_falls_back_eagerly():
    """Past tile:graph_limit a run stops with an error naming the setting; with graph_fallback
    the further geometries run eagerly, are counted, and the step stays exact."""
    with pytest.raises(ConfigError, match="tile:graph_limit"):
        train_step(256, 128, torch.float64, {"levels": 1, "tiles": 4,
                                             "graphs": TileGraphs(Emulated(), limit=2)})
    graphs = TileGraphs(Emulated(), limit=2, fallback=True)
    got = train_step(256, 128, torch.float64, {"levels": 1, "tiles": 4, "graphs": graphs})
    assert graphs.record["graphs_captured"] == 2 and graphs.record["eager_tiles"] > 0
    assert_exact(got, untiled_step(256, 128, torch.float64), TOL[torch.float64])


def test_tiled_step_float32_as_accurate_as_untiled():
    """Float32: per tensor, the tiled step's error against the float64 step is at most
    max(1e-4, 3 x the untiled float32 step's error). (A plain 1e-4 between the two float32 runs
    would not hold: gradients of deep BatchNorm biases are sums that cancel to ~1e-2 relative
    rounding noise in float32, tiled or not.)"""
    exact = untiled_step(256, 256, torch.float64)
    plain = relative_errors(untiled_step(256, 256, torch.float32), exact)
    tiled = relative_errors(train_step(256, 256, torch.float32, {"levels": 2, "tiles": 4}), exact)
    over = {n: (tiled[n], plain[n]) for n in exact
            if tiled[n] > max(TOL[torch.float32], 3 * plain[n])}
    assert not over, f"tiled float32 less accurate than untiled: {over}"


def test_statistics_gradients_matter():
    """The check above is sensitive to what tiling must get right: a model whose BatchNorm
    statistics were the tiles' own (what naive tiling does) is far off."""
    plain = untiled_step(256, 256, torch.float64)
    model = build_unet(seed=0).double()
    x, _ = _batch(256, 256, torch.float64)
    tile_out = torch.cat([model(x[..., i:i + 128, :]) for i in (0, 128)], dim=-2)
    error = ((tile_out - plain["out"]).norm() / plain["out"].norm()).item()
    assert error > 1e3 * TOL[torch.float64]


def _eval_model():
    model = build_unet(seed=0).double()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # running statistics unlike the batch's, so normalisation matters
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5, generator=gen)
                m.running_var.uniform_(0.5, 2.0, generator=gen)
    return model.eval()


def test_streamed_eval_forward_equals_untiled():
    """A validation batch in host memory (tile:stream) is tiled down to 1/8 res with its
    boundaries on the host (validation.streamed_levels, forward_padded_as(stream=True))."""
    from memstudy.tiling.validation import forward_padded_as, streamed_levels

    model = _eval_model()
    x, _ = _batch(270, 200, torch.float64)
    assert streamed_levels(model) == 4
    with torch.no_grad():
        plain = model(x)
        with forward_padded_as(model, 64, streamed_levels(model), stream=True):
            assert model.forward_padded.kept_on_host == {"l1"}  # layer2 and block 2 read it
            tiled = model(x)
    assert ((tiled - plain).norm() / plain.norm()).item() < TOL[torch.float64]


@pytest.mark.parametrize("rows", [32, 96])
def test_tiled_eval_forward_equals_untiled(rows):
    model = _eval_model()
    x, _ = _batch(270, 200, torch.float64)
    with torch.no_grad():
        tiled, how = validation_forward(model, x, rows)
        plain, how_plain = validation_forward(model, x, 0)
    assert how.startswith("tiled") and how_plain.startswith("untiled")
    assert tiled.shape == plain.shape == x.shape
    assert ((tiled - plain).norm() / plain.norm()).item() < TOL[torch.float64]
    assert "forward_padded" not in vars(model)  # the model is left as it was


def test_split_rows_uneven_and_by_rows():
    assert split_rows(64, tiles=3) == [(0, 21), (21, 43), (43, 64)]
    assert split_rows(72, rows=20) == [(0, 20), (20, 40), (40, 60), (60, 72)]
    with pytest.raises(ValueError):
        split_rows(4, tiles=5)


@pytest.mark.parametrize("techniques, levels", [([], 3), (["invertible"], 2)])
def test_training_loop_validation_tiled_equals_untiled(techniques, levels):
    """train._evaluate goes through the tiled forward (train.val_tile_rows) and gives the same
    validation figures as the untiled forward (val_tile_rows = 0); with invertible, whose
    momentum blocks replace the layer1 that levels=3 tiles, at levels=2."""
    from conftest import small_config

    from memstudy.datasets import build_datasets
    from memstudy.techniques.compose import build_pipeline, make_plan
    from memstudy.train import _evaluate

    cfg = small_config(size=200, val_tile_rows=32, techniques=techniques)  # 224 rows: 7 strips
    build = build_pipeline(make_plan(cfg))
    _, val_set = build_datasets(cfg.data, cfg.train.image_size, cfg.train.batch_size)
    tiled = _evaluate(build, val_set)
    assert build.notes["val_tiling"] == f"tiled: levels={levels}, rows=32"
    cfg.train.val_tile_rows = 0
    plain = _evaluate(build, val_set)
    assert build.notes["val_tiling"].startswith("untiled")
    assert tiled.keys() == plain.keys()
    for name, value in plain.items():
        assert tiled[name] == pytest.approx(value, rel=1e-5), name


def test_region_functions_share_one_input_gradient(monkeypatch):
    """A region's K+1 Functions add into one full-size gradient per input (the last backward
    returns it), instead of one each that autograd then sums: at levels=2 / keep=all the step
    allocates 5 full-size input gradients (stem: x; block3.conv1: d3, x; block4.conv1: z3;
    top: z4), not 10 (one per Function and input), and each reaches autograd exactly once."""
    from memstudy.tiling import sweep as sweep_module

    allocated, returned = [], []
    real_input_grad, real_settle = sweep_module.Sweep.input_grad, sweep_module.Sweep.settle

    def input_grad(self, i, like):
        if self.input_grads[i] is None:
            allocated.append((self.region.name, i))
        return real_input_grad(self, i, like)

    def settle(self, i):
        grad = real_settle(self, i)
        if grad is not None:
            returned.append((self.region.name, i))
        return grad

    monkeypatch.setattr(sweep_module.Sweep, "input_grad", input_grad)
    monkeypatch.setattr(sweep_module.Sweep, "settle", settle)
    tiled = train_step(128, 160, torch.float64, {"levels": 2, "tiles": 3, "keep": "all"})
    expected = [("block3.conv1", 0), ("block3.conv1", 1), ("block4.conv1", 0), ("stem", 0),
                ("top", 0)]
    assert sorted(allocated) == expected and sorted(returned) == expected
    assert_exact(tiled, untiled_step(128, 160, torch.float64), TOL[torch.float64])



def test_strip_gradient_keeps_the_strips_layout():
    """The gradient a tile's backward starts from: the owned rows' gradient placed in a zero
    gradient of the whole strip, in the strip's memory format. Backpropagating through the
    crop instead (SliceBackward) gives the contiguous format for a channels_last strip, and
    every op of the tile's backward after it then mixes layouts (strided kernels and layout
    copies on a GPU)."""
    from memstudy.tiling.geometry import Tile
    from memstudy.tiling.sweep import TileRun, strip_gradient

    full = torch.rand(1, 8, 10, 6).to(memory_format=torch.channels_last).requires_grad_()
    run = TileRun(None, Tile(own=(1, 3), strip=(0, 5)), [])  # rows 2..6 of 10 (factor 2)
    owned = torch.rand(1, 8, 4, 6).to(memory_format=torch.channels_last)
    grad = strip_gradient(run, full, owned)
    assert grad.is_contiguous(memory_format=torch.channels_last) and grad.stride() == full.stride()
    assert torch.equal(grad[..., 2:6, :], owned)
    assert grad[..., :2, :].abs().sum() == 0 and grad[..., 6:, :].abs().sum() == 0
    (through_crop,) = torch.autograd.grad(run.owned(full * 1), full, owned)
    assert torch.equal(through_crop, grad)  # the same values ...
    assert not through_crop.is_contiguous(memory_format=torch.channels_last)  # ... other layout


@pytest.mark.parametrize("skip_channels", [0, 3])
def test_folded_up_convolution_equals_upsampling_then_convolution(skip_channels):
    """TensorOps.up_conv (a stride-2 transposed convolution of the folded weights, plus the
    skip's convolution) against nearest up-sampling, concatenation and the 3 x 3 convolution,
    in float64 within 1e-12 relative, values and gradients, on odd sizes, with a bias."""
    from memstudy.tiling.tiled_forward import TensorOps

    gen = torch.Generator().manual_seed(5)
    conv = torch.nn.Conv2d(4 + skip_channels, 6, 3, padding=1).double()
    d = torch.randn(2, 4, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    skip = torch.randn(2, skip_channels, 10, 14, generator=gen, dtype=torch.float64,
                       requires_grad=True) if skip_channels else None
    ops = TensorOps(None, {"c": conv}, {})
    folded = ops.up_conv("c", d, skip)
    up = torch.nn.functional.interpolate(d, scale_factor=2, mode="nearest")
    plain = conv(up if skip is None else torch.cat([up, skip], dim=1))
    grad = torch.randn(plain.shape, generator=gen, dtype=torch.float64)
    leaves = [d, conv.weight, conv.bias] + ([skip] if skip is not None else [])
    got = torch.autograd.grad(folded, leaves, grad)
    want = torch.autograd.grad(plain, leaves, grad)
    for a, b in [(folded, plain), *zip(got, want)]:
        assert ((a - b).norm() / b.norm()).item() < 1e-12


def test_stream_keeps_in_host_memory_only_what_tiled_regions_read():
    """tile:stream: the layer1 regions' and the decoder's kept boundaries, not the untiled
    levels' input (`low`) nor the network output (`out`); none without stream."""
    model = build_unet(seed=0)
    specs = dict(levels=3, tiles=3, layer1="convs")
    assert TiledForward(model, **specs).host_outputs() == set()
    assert TiledForward(model, **specs, stream=True).host_outputs() == {
        "p0", "a0", "p1", "a1", "p2", "a2", "z2", "z3"}
    assert TiledForward(model, levels=2, stream=True).host_outputs() == {"z3"}
    at4 = TiledForward(model, levels=4, layer1="blocks", stream=True)
    assert at4.host_outputs() == {"p0", "p1", "p2", "l1", "q1", "q2", "q3", "z1", "z2", "z3"}
    # layer1's output is layer2's input and decoder block 2's skip: kept, 64 channels at 1/4
    assert at4.boundary_shape("l1") == (64, 4) and at4.boundary_shape("q1") == (128, 8)
