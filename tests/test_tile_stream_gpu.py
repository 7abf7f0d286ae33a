"""tile:stream on a GPU: the boundaries only tiled regions read lie in pinned host memory, the
step's values are the device path's, and the device's peak drops by what they held."""
from __future__ import annotations

import pytest
import torch

from memstudy.models import build_unet
from memstudy.tiling import sweep
from memstudy.tiling.tiled_forward import TiledForward

pytestmark = pytest.mark.gpu

TILING = dict(levels=3, tiles=4, layer1="convs", kernels="torch")


def _step(size: int, stream: bool, dtype: torch.dtype = torch.float32):
    """One training step of the tiled ResNet-34 U-Net on the GPU; its output, input gradient,
    parameter gradients and the device's peak above the step's start."""
    torch.manual_seed(0)
    model = build_unet(seed=0).to("cuda", dtype).train()
    model.forward_padded = TiledForward(model, **TILING, stream=stream)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(1, 1, size, size, generator=g, dtype=dtype).cuda().requires_grad_(True)
    y = torch.rand(1, 1, size, size, generator=g, dtype=dtype).cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = model(x)
    ((out - y) ** 2).mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.detach(), x.grad.detach(), grads, peak


def test_stream_places_boundaries_in_pinned_host_memory(monkeypatch):
    made = []
    full_like = sweep._full_like

    def recording(part, inputs, sw):
        out = full_like(part, inputs, sw)
        made.append((sw.region.name, out.device.type, out.is_pinned() if out.device.type ==
                     "cpu" else None))
        return out

    monkeypatch.setattr(sweep, "_full_like", recording)
    _step(256, stream=True)
    on_host = {name for name, device, pinned in made if device == "cpu"}
    assert all(pinned for _n, device, pinned in made if device == "cpu")
    assert on_host == {"stem", "layer1.0.conv1", "layer1.0", "layer1.1.conv1", "layer1.1",
                       "layer1.2.conv1", "block2.conv1", "block3.conv1"}
    assert {name for name, device, _p in made if device == "cuda"} == {"layer1.2", "top"}


def test_stream_step_equals_the_device_step_and_holds_less():
    """Same values (float64, relative 1e-10: stream also folds the untiled decoder blocks'
    up-sampling, which sums the same products in another order) and a lower device peak at
    1024 px, where the host boundaries are 8 of 64 channels x 256 x 256 and more."""
    plain = _step(1024, stream=False, dtype=torch.float64)
    streamed = _step(1024, stream=True, dtype=torch.float64)
    for a, b in zip((plain[0], plain[1], *plain[2].values()),
                    (streamed[0], streamed[1], *streamed[2].values())):
        assert ((a - b).norm() / a.norm().clamp_min(1e-30)).item() < 1e-10
    assert streamed[3] < plain[3]


@pytest.mark.parametrize("layer1", ["convs", "blocks"])  # tile:auto's plan sets 1 and 2
def test_copies_a_tile_ahead_change_no_value(layer1):
    """tile:ahead moves the streamed copies to a side stream and starts them a tile early; the
    kernels and their order are the same, so the float64 step is the one with the copies on
    the compute stream to 1e-12 relative (cuDNN's backward may sum in another order from run to
    run; a copy read before it landed would differ by far more)."""
    def step(ahead: bool):
        torch.manual_seed(0)
        model = build_unet(seed=0).to("cuda", torch.float64).train()
        model.forward_padded = TiledForward(model, levels=4, tiles=4, layer1=layer1,
                                            kernels="torch", stream=True, ahead=ahead)
        g = torch.Generator().manual_seed(3)
        x = torch.rand(1, 1, 1024, 768, generator=g, dtype=torch.float64).cuda()
        y = torch.rand(1, 1, 1024, 768, generator=g, dtype=torch.float64).cuda()
        out = model(x)
        ((out - y) ** 2).mean().backward()
        torch.cuda.synchronize()
        return [out.detach(), *(p.grad for p in model.parameters())]

    for a, b in zip(step(False), step(True)):
        assert ((a - b).norm() / a.norm().clamp_min(1e-30)).item() < 1e-12


@pytest.mark.parametrize("task", ["enhance", "segment"])
def test_a_host_target_gives_the_device_target_loss_and_gradient(task):
    """The chunked losses read a target in pinned host memory a block at a time: the value and
    the output's gradient are those of the same target on the device."""
    from memstudy.msssim_chunked import chunked_msssim
    from memstudy.segment_loss import segment_loss

    g = torch.Generator().manual_seed(2)
    out = torch.rand(1, 1, 600, 500, generator=g, dtype=torch.float64).cuda()
    target = torch.rand(1, 1, 600, 500, generator=g, dtype=torch.float64)
    if task == "segment":
        out, target = out * 4 - 2, (target > 0.5).double()
    loss = ((lambda o, t: chunked_msssim(o, t, [0.0448, 0.2856, 0.3001, 0.2363, 0.1333], 11, 64))
            if task == "enhance" else (lambda o, t: segment_loss(o, t, 1, 64)))
    results = []
    for t in (target.cuda(), target.pin_memory()):
        o = out.clone().requires_grad_(True)
        value = loss(o, t)
        value.backward()
        results.append((value.detach(), o.grad))
    (v_dev, g_dev), (v_host, g_host) = results
    assert torch.allclose(v_host, v_dev, rtol=1e-12, atol=0)
    assert torch.allclose(g_host, g_dev, rtol=1e-12, atol=1e-300)


def test_a_streamed_run_keeps_its_batches_on_the_host(make_config):
    """Through the technique: the runtime keeps batches in host memory, the forward takes a
    pinned host image and target, its loss is the device path's (bf16: relative 1e-2), and the
    run counts the bytes its streamed copies moved each way."""
    from memstudy.techniques.compose import build_pipeline, make_plan

    losses = []
    for stream in (False, True):
        spec = "tile:4:levels=3:layer1=convs" + (":stream=true" if stream else "")
        build = build_pipeline(make_plan(make_config(512, ["amp:bf16", "checkpoint", spec],
                                                     device="cuda")))
        assert build.runtime.inputs_on_host is stream
        g = torch.Generator().manual_seed(0)
        x, y = (torch.rand(1, 1, 512, 512, generator=g) for _ in range(2))
        if stream:
            x, y = x.pin_memory(), y.pin_memory()
        else:
            x, y = x.cuda(), y.cuda()
        losses.append(build.runtime.forward(build.model, x, y).item())
        moved = {name: value for src in build.runtime.series_sources
                 for _rank, _step, name, value in src() if name.startswith("stream_")}
        # the forward brought strips in and wrote boundaries out; the device path moves none
        assert (moved["stream_h2d_bytes"] > 0 and moved["stream_d2h_bytes"] > 0) if stream \
            else moved == {}
    assert abs(losses[1] - losses[0]) <= 1e-2 * abs(losses[0])


def test_a_host_validation_batch_is_tiled_with_host_boundaries():
    """validation_forward of a batch in pinned host memory (tile:stream's batches) tiles down to
    1/8 res with host boundaries, says so, and gives the untiled device forward's output."""
    from memstudy.tiling.validation import validation_forward

    model = build_unet(seed=0).to("cuda", torch.float64).eval()
    x = torch.rand(1, 1, 512, 384, generator=torch.Generator().manual_seed(4),
                   dtype=torch.float64).pin_memory()
    with torch.no_grad():
        plain, _ = validation_forward(model, x.cuda(), 0)
        streamed, how = validation_forward(model, x, 128)
    assert how == "tiled: levels=4, rows=128, boundaries in host memory"
    assert ((streamed - plain).norm() / plain.norm()).item() < 1e-10


def test_validation_figures_of_a_host_target_equal_the_device_targets():
    """quality() reads a target in pinned host memory by blocks of rows (its MSE too). The
    figures are float32 (quality() casts), and a host target's MSE is summed by blocks where
    the device's is one torch.mean: the two orders differ by float32 rounding (measured 6e-8
    relative on an H200), so 1e-6; a block read from the wrong rows differs by far more."""
    from memstudy.quality import quality

    g = torch.Generator().manual_seed(6)
    out = torch.rand(2, 1, 600, 500, generator=g, dtype=torch.float64).cuda()
    target = torch.rand(2, 1, 600, 500, generator=g, dtype=torch.float64).pin_memory()
    on_host = quality(out, target, 5, chunk_rows=64)
    on_device = quality(out, target.cuda(), 5, chunk_rows=64)
    assert on_host.keys() == on_device.keys()
    for name, value in on_device.items():
        assert abs(on_host[name] - value) <= 1e-6 * max(1.0, abs(value)), name


@pytest.mark.parametrize("layer1, ahead", [("convs", False), ("blocks", True)])
def test_levels4_stream_step_equals_the_untiled_step_in_float64(layer1, ahead):
    """levels=4 with stream (layer2 and decoder block 1 tiled, boundaries on the host) against
    the plain untiled network on the GPU: float64, relative 1e-10 for the output, the input's
    gradient and every parameter's gradient; cut at the convolutions with the copies on the
    compute stream, and as tile:auto streams: at the blocks, copies a tile ahead."""
    def step(tiled: bool):
        torch.manual_seed(0)
        model = build_unet(seed=0).to("cuda", torch.float64).train()
        if tiled:
            model.forward_padded = TiledForward(model, levels=4, tiles=3, layer1=layer1,
                                                kernels="torch", stream=True, ahead=ahead)
        g = torch.Generator().manual_seed(2)
        x = torch.rand(1, 1, 768, 512, generator=g, dtype=torch.float64).cuda()
        y = torch.rand(1, 1, 768, 512, generator=g, dtype=torch.float64).cuda()
        x.requires_grad_(True)
        out = model(x)
        ((out - y) ** 2).mean().backward()
        return [out.detach(), x.grad, *(p.grad for p in model.parameters())]

    for a, b in zip(step(False), step(True)):
        assert ((a - b).norm() / a.norm().clamp_min(1e-30)).item() < 1e-10


@pytest.mark.large
@pytest.mark.alone
def test_a_16384_px_step_trains_under_an_8_gib_cap_with_tile_auto(tmp_path):
    """memstudy run at 16384 x 16384 with tile:auto under --budget 8GiB (CUDA context
    included): one warm-up step (after which the cap is set by the context as it has grown:
    budget.recap_after_warmup), one measured step and validation, in its own process (the budget caps the
    process's allocator); status ok, the process's NVML peak within the budget, the pick
    recorded."""
    import json
    import sqlite3
    import subprocess
    import sys

    from memstudy.byte_sizes import parse_bytes

    db = tmp_path / "auto.sqlite"
    techniques = ("amp:bf16,checkpoint,offload:which=boundaries:prefetch=1,tile:auto,"
                  "allocator:expandable_segments=true")
    done = subprocess.run(
        [sys.executable, "-m", "memstudy", "--db", str(db), "run", "--size", "16384",
         "-t", techniques, "--device", "cuda", "--budget", "8GiB", "--steps", "2", "-q",
         "--set", "train.warmup_steps=1", "--set", "train.measure_steps=1",
         "--set", "data.train_images=2", "--set", "data.val_images=1"],
        capture_output=True, text=True, timeout=570)
    assert done.returncode == 0, done.stderr[-2000:]
    with sqlite3.connect(db) as con:
        status, env = con.execute("select status, env_json from runs").fetchone()
        nvml = con.execute("select value from metrics where phase = 'run' and "
                           "name = 'nvml_process_peak_bytes'").fetchone()[0]
    assert status == "ok"
    assert nvml <= parse_bytes("8GiB")
    picked = json.loads(env)["notes"]["tile"]["auto"]
    assert picked["plan"] == "levels4-stream-blocks"
    print(f"16384 px, tile:auto under 8 GiB: status {status}, NVML peak {nvml / 2**20:.0f} MiB, "
          f"picked {picked}")  # the log's record (gpu.sh tile-auto-large shows it: -rP)
