"""The fast tiled step on a GPU: no host sync inside a step, CUDA-graph tiles exact against the
eager ones, boundary offload's copies back hidden by prefetch (docs/techniques/tile.md)."""
from __future__ import annotations

import pytest
import torch

from memstudy.models import build_unet
from memstudy.techniques.compose import build_pipeline, make_plan
from memstudy.tiling.graphs import CudaGraphs, TileGraphs
from memstudy.tiling.tiled_forward import TiledForward

pytestmark = pytest.mark.gpu

FAST = ["amp:bf16", "checkpoint", "offload:which=boundaries:prefetch=2",
        "tile:4:keep=all:graphs=true"]


def _pipeline(make_config, size: int, techniques: list[str]):
    cfg = make_config(size, techniques, device="cuda", channels_last=True, cudnn_benchmark=True)
    build = build_pipeline(make_plan(cfg))
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1, 1, size, size, generator=g).cuda().to(memory_format=torch.channels_last)
    y = torch.rand(1, 1, size, size, generator=g).cuda().to(memory_format=torch.channels_last)
    return build, x, y


def _step(build, optimizer, x, y) -> torch.Tensor:
    rt = build.runtime
    loss = rt.forward(build.model, x, y)
    rt.backward(loss)
    rt.step(optimizer)
    return loss


@pytest.mark.parametrize("techniques", [FAST, ["amp:bf16", "checkpoint",
                                               "offload:which=boundaries", "tile:4:keep=all"],
                                        ["amp:bf16", "checkpoint", "offload:which=boundaries",
                                         "tile:4:keep=bn"],
                                        ["amp:bf16", "checkpoint",
                                         "offload:which=boundaries:prefetch=1", "tile:4:keep=half"],
                                        ["amp:bf16", "checkpoint",
                                         "offload:which=boundaries:prefetch=1:hold=1",
                                         "tile:4:keep=all"],
                                        ["amp:bf16", "checkpoint",
                                         "offload:which=boundaries:prefetch=1:hold=1:release=stream"
                                         ":early=true", "tile:4:keep=all"],
                                        ["amp:bf16", "checkpoint", "offload:which=boundaries",
                                         "tile:4:levels=3:layer1=convs"]],
                         ids=["graphs-prefetch", "eager", "eager-keep-bn", "eager-keep-half-prefetch",
                              "eager-hold", "eager-hold-release-stream-early",
                              "eager-layer1-convs"])
def test_gpu_tiled_step_never_syncs_with_the_host(make_config, techniques):
    """After two warm-up steps (cuDNN's choices, graph captures), a whole training step of the
    ladder's technique set (forward with the chunked loss at its auto block height, backward,
    optimizer step) runs with torch.cuda.set_sync_debug_mode("error"): any blocking host-device
    synchronisation raises."""
    build, x, y = _pipeline(make_config, 512, techniques)
    optimizer = build.runtime.optimizer_factory(build.model)
    for _ in range(2):
        _step(build, optimizer, x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = _step(build, optimizer, x, y)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss).item()


def _grads(layout: dict, graphs: bool, dtype: torch.dtype, autocast: bool,
           kernels: str = "triton"):
    torch.backends.cudnn.benchmark = True
    x = torch.rand(1, 1, 256, 320, device="cuda", dtype=dtype,
                   generator=torch.Generator("cuda").manual_seed(0))
    model = build_unet(seed=0).cuda().to(dtype).to(memory_format=torch.channels_last)
    tiled = TiledForward(model, **layout, graphs=TileGraphs(CudaGraphs()) if graphs else None,
                         kernels=kernels)
    if layout:
        model.forward_padded = tiled
    x = x.to(memory_format=torch.channels_last)
    for _ in range(2):  # the second step replays what the first captured
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    return {n: p.grad.detach().double() for n, p in model.named_parameters()}


def _error(got: dict, want: dict) -> float:
    num = sum((got[n] - want[n]).square().sum() for n in want)
    return float((num / sum(w.square().sum() for w in want.values())).sqrt())


@pytest.mark.parametrize("layout", [{"levels": 2, "tiles": 4, "keep": "all"},
                                    {"levels": 3, "tiles": 3, "keep": "conv1"},
                                    {"levels": 2, "tiles": 4, "keep": "bn"},
                                    {"levels": 3, "tiles": 3, "keep": "conv1", "layer1": "convs"}])
@pytest.mark.slow
def test_gpu_graphed_tiles_equal_eager_tiles(layout):
    """CUDA-graph replays of the tile bodies against the eager tiles: bf16 autocast within 1e-2
    relative over all gradients (the same kernels; cuDNN may choose other algorithms for the
    staged strips), and float64 against the untiled step within 1e-10."""
    graphed = _grads(layout, True, torch.float32, True)
    eager = _grads(layout, False, torch.float32, True)
    assert _error(graphed, eager) < 1e-2
    exact = _grads(layout, True, torch.float64, False)
    plain = _grads({}, False, torch.float64, False)
    assert _error(exact, plain) < 1e-10


@pytest.mark.parametrize("layout", [{"levels": 2, "tiles": 4, "keep": "all"},
                                    {"levels": 3, "tiles": 3, "keep": "conv1", "layer1": "convs"}])
def test_gpu_triton_norm_kernels_match_the_primitives_in_a_tiled_step(layout):
    """tile:norm=triton against tile:norm=torch (PyTorch's SyncBatchNorm primitives) over every
    gradient of a float32 tiled step (TF32 off): within 1e-2 relative (H100: 2.5e-3 and
    3.3e-3; the CPU, kernels interpreted: 1.7e-3; the tiled and untiled float32 steps differ
    by 5e-3: this randomly initialised model amplifies rounding about 1e4-fold). A kernel bug
    (a lost ReLU mask, a wrong sum) moves them by O(1). Under bf16 autocast a step-level bound
    says nothing: one bf16 rounding flipped anywhere moves the gradients by about 0.22
    relative, with either kernels (levels=3: norm=triton 0.228, norm=torch 0.224 from the
    untiled step); the kernels' bf16 outputs are held to one rounding of the primitives'
    on the tiled levels' strip shapes (tests/test_kernels_norm_act.py)."""
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        error = _error(_grads(layout, False, torch.float32, False, "triton"),
                       _grads(layout, False, torch.float32, False, "torch"))
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    assert error < 1e-2


def _offload_stats(build) -> dict[str, float]:
    rows = [r for source in build.runtime.series_sources for r in source()]
    return {name[len("offload_"):]: value for _, _, name, value in rows
            if name.startswith("offload_")}


@pytest.mark.parametrize("prefetch,row_chunks", [(0, 0), (0, 16), (2, 16)])
def test_gpu_prefetch_hides_the_copies_back(make_config, prefetch, row_chunks):
    """Boundary offload at 1024 px: every tile boundary crosses the bus both ways (bytes
    recorded each way, equal). Without prefetch or row chunks every copy back is on the
    critical path (exposed = copy time); tile region inputs brought back by rows, their tiles
    waiting for their strips only, hide part of it, and prefetch=2 more."""
    techniques = ["amp:bf16", "checkpoint",
                  f"offload:which=boundaries:prefetch={prefetch}:row_chunks={row_chunks}",
                  "tile:4:keep=all:graphs=true"]
    build, x, y = _pipeline(make_config, 1024, techniques)
    optimizer = build.runtime.optimizer_factory(build.model)
    for _ in range(3):
        _step(build, optimizer, x, y)
    torch.cuda.synchronize()
    stats = _offload_stats(build)
    assert stats["d2h_bytes"] > 0 and stats["h2d_bytes"] >= stats["d2h_bytes"] * 0.99
    assert stats["h2d_copy_ms"] > 0
    assert (stats["by_rows"] > 0) == (row_chunks > 0), stats
    if prefetch:
        assert stats["h2d_exposed_ms"] < 0.8 * stats["h2d_copy_ms"], stats
    elif row_chunks:
        assert stats["h2d_exposed_ms"] < 0.9 * stats["h2d_copy_ms"], stats
    else:
        assert stats["h2d_exposed_ms"] == pytest.approx(stats["h2d_copy_ms"]), stats


def _float64_step(make_config, techniques: list[str], hw: tuple[int, int],
                  memory_format=torch.contiguous_format):
    """The built pipeline of `techniques` at hw (channels_last weights, no autotuning), its model
    in float64, and a seeded float64 input and target in `memory_format`."""
    cfg = make_config(hw[0], techniques, device="cuda", channels_last=True,
                      cudnn_benchmark=False)
    cfg.meter.tensor = "off"
    build = build_pipeline(make_plan(cfg))
    g = torch.Generator().manual_seed(0)
    x, y = (torch.rand(1, 1, *hw, generator=g, dtype=torch.float64).cuda()
            .to(memory_format=memory_format) for _ in range(2))
    return build, build.model.double(), x, y


@pytest.mark.parametrize("tile", ["tile:4:keep=all", "tile:3:levels=3:keep=conv1:layer1=convs"])
def test_gpu_boundaries_brought_back_by_rows_give_the_same_gradients(make_config, tile):
    """float64, the same step with the tile region inputs brought back in 16 row chunks (each
    tile waiting for its strip's) and whole: every gradient within 1e-12 relative (the same
    bytes arrive; a tile that read rows before they landed would be off by far more)."""
    def grads(row_chunks):
        techniques = ["checkpoint", f"offload:which=boundaries:row_chunks={row_chunks}", tile]
        build, model, x, y = _float64_step(make_config, techniques, (320, 288),
                                           torch.channels_last)
        with build.runtime.forward_context():  # offload's saved-tensor hooks
            loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        torch.cuda.synchronize()
        assert (_offload_stats(build)["by_rows"] > 0) == (row_chunks > 0)
        return {n: p.grad.detach() for n, p in model.named_parameters()}

    assert _error(grads(16), grads(0)) < 1e-12


@pytest.mark.parametrize("variant", ["release=stream", "early=true", "early=true:release=stream",
                                     "back_pool=side", "back_pool=side:release=stream"])
def test_gpu_early_copies_and_stream_order_release_give_the_same_gradients(make_config, variant):
    """float64, the 4 GiB set's offload with its copies out started as each region begins
    (early) and / or their memory released in stream order (release=stream: no record_stream;
    the compute stream waits for each copy when its tensor is freed), against the default:
    every gradient within 1e-12 relative (a copy that read a boundary before it was written, or
    a block reused before its copy had read it, would be off by far more). back_pool=side: the
    copies back (prefetched and by rows) in the side stream's own memory, not waiting for the
    compute stream."""
    def grads(options):
        techniques = ["checkpoint", f"offload:which=boundaries:prefetch=1:hold=1{options}",
                      "tile:4:keep=all"]
        build, model, x, y = _float64_step(make_config, techniques, (320, 288),
                                           torch.channels_last)
        for _ in range(2):  # the second step holds the last boundary (hold counts the first)
            model.zero_grad(set_to_none=True)
            with build.runtime.forward_context():
                loss = ((model(x) - y) ** 2).mean()
            loss.backward()
        torch.cuda.synchronize()
        if "early" in options:
            assert _offload_stats(build)["early"] > 0
        return {n: p.grad.detach() for n, p in model.named_parameters()}

    assert _error(grads(":" + variant), grads("")) < 1e-12


@pytest.mark.parametrize("tile", ["tile:4:keep=all", "tile:4:levels=3:layer1=blocks"])
@pytest.mark.slow
def test_gpu_compiled_untiled_levels_equal_the_eager_step(make_config, tile):
    """compile + tile with Inductor's kernels (Triton) for the untiled levels' modules, in
    float64 against the same set without compile: every gradient within 1e-9 relative (a
    correct graph differs by rounding only; bf16 would hide a wrong one in its noise)."""
    def grads(techniques):
        _, model, x, y = _float64_step(make_config, techniques, (256, 256))
        ((model(x) - y) ** 2).mean().backward()
        return {n: p.grad.detach() for n, p in model.named_parameters()}

    eager = grads(["checkpoint", tile])
    compiled = grads(["checkpoint", tile, "compile"])
    assert _error(compiled, eager) < 1e-9

