"""The MS-SSIM loss's own memory: measured as a category of its own, and the chunked loss that
keeps pytorch-msssim's value and gradient without its full-resolution maps."""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from pytorch_msssim import ms_ssim, ssim

from memstudy.config import MeterConfig
from memstudy.meters import PhaseRecorder
from memstudy.quality import WIN_SIZE, MSSSIMLoss, msssim, msssim_weights, quality
from memstudy.techniques.compose import build_pipeline, make_plan

TOLERANCE = 1e-12  # float64: value and gradient agree to rounding (sums in another order)


def _pair(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g, dtype=torch.float64)
    y = (0.6 * torch.rand(shape, generator=g, dtype=torch.float64) + 0.4 * x)
    return x.requires_grad_(True), y.requires_grad_(True)


def _reference(x, y, scales):
    if scales == 1:
        return 1 - ssim(x, y, data_range=1.0, win_size=WIN_SIZE)
    return 1 - ms_ssim(x, y, data_range=1.0, win_size=WIN_SIZE, weights=msssim_weights(scales))


@pytest.mark.parametrize("shape, scales, rows", [
    ((2, 1, 200, 296), 5, 37),   # rectangular, batch 2, blocks that do not divide the rows
    ((1, 1, 225, 225), 5, 256),  # one block per scale
    ((1, 2, 170, 190), 3, 7),    # two channels, three scales, many small blocks
    ((2, 1, 40, 52), 1, 5),      # one scale: plain SSIM
])
def test_chunked_loss_equals_pytorch_msssim_in_value_and_gradient(shape, scales, rows):
    x, y = _pair(shape)
    reference = _reference(x, y, scales)
    ref_gx, ref_gy = torch.autograd.grad(reference, [x, y])
    chunked = 1 - msssim(x, y, msssim_weights(scales), chunk_rows=rows)  # what MSSSIMLoss runs
    gx, gy = torch.autograd.grad(chunked, [x, y])
    assert abs(float(chunked.detach() - reference.detach())) <= TOLERANCE
    for got, want in ((gx, ref_gx), (gy, ref_gy)):
        assert float((got - want).abs().max()) <= TOLERANCE * float(want.abs().max())


def test_chunked_loss_without_grad_builds_no_gradient_maps(monkeypatch):
    """Under no_grad (or on inputs that need no gradient) only the value is computed: the
    one-pass blocks would otherwise build gradient maps nobody reads."""
    import memstudy.msssim_chunked as chunked

    x, y = _pair((1, 1, 200, 296))
    want = float(_reference(x, y, 5).detach())
    level_pass, needs = chunked._level_pass, []
    monkeypatch.setattr(chunked, "_level_pass",
                        lambda *a: needs.append(a[-1]) or level_pass(*a))
    with torch.no_grad():
        got = 1 - msssim(x, y, msssim_weights(5), chunk_rows=37)
    assert abs(float(got) - want) <= TOLERANCE
    assert abs(float(1 - msssim(x.detach(), y.detach(), msssim_weights(5), 37)) - want) <= TOLERANCE
    assert len(needs) == 10 and set(needs) == {(False, False)}  # 5 scales, twice: no gradient maps


def test_loss_module_in_float32_matches_pytorch_msssim():
    """MSSSIMLoss computes in float32: equal to pytorch-msssim in float32 up to the rounding of
    sums taken in another order (1e-5 relative)."""
    x, y = (t.detach().float().requires_grad_(True) for t in _pair((1, 1, 200, 296), seed=1))
    reference = _reference(x, y, 5)
    want = torch.autograd.grad(reference, x)[0]
    chunked = MSSSIMLoss(5, chunk_rows=64)(x, y)
    got = torch.autograd.grad(chunked, x)[0]
    assert float(chunked.detach()) == pytest.approx(float(reference.detach()), rel=1e-5)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_chunked_validation_figures_equal_pytorch_msssim():
    """quality() works in float32, like MSSSIMLoss: 1e-6 relative."""
    x, y = (t.detach().float() for t in _pair((2, 1, 200, 296), seed=3))
    chunked, plain = quality(x, y, 5, chunk_rows=37), quality(x, y, 5, chunk_rows=0)
    for name in ("loss", "ssim", "psnr"):
        assert chunked[name] == pytest.approx(plain[name], rel=1e-6)
    assert plain["loss"] == pytest.approx(float(_reference(x, y, 5)), rel=1e-6)


def _measured_step(cfg):
    """One measured forward + backward through the composed pipeline, tensor meter on."""
    build = build_pipeline(make_plan(cfg))
    model, rt = build.model, build.runtime
    rec = PhaseRecorder(build.device, model, rt, lambda: None, MeterConfig(tensor="on"))
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(1, 1, 192, 224, generator=g), torch.rand(1, 1, 192, 224, generator=g)
    with rec.step(measured=True):
        with rec.phase("forward"):
            loss = rt.forward(model, x, y)
        with rec.phase("backward"):
            rt.backward(loss)
    out = model(x).detach().requires_grad_(True)  # the loss alone, counted independently
    return rec.measured["forward"][0], rec.measured["backward"][0], _alive_saved(rt.loss_fn, out, y)


def _alive_saved(fn, *args) -> int:
    """Bytes of the distinct storages autograd saved in fn(*args) that are still alive while
    its result is (pytorch-msssim computes branches it drops, and their saved maps with them);
    the storage of an input that requires grad (in a run, the model's output: the model's own
    saved tensor) is excluded. Independent of memstudy's meters."""
    seen: dict[int, tuple[int, weakref.ref]] = {}
    inputs = {a.untyped_storage().data_ptr() for a in args if a.requires_grad}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            seen[storage.data_ptr()] = (storage.nbytes(), weakref.ref(storage))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args)
    gc.collect()
    alive = sum(n for n, ref in seen.values() if ref() is not None)
    del result
    return alive


def test_loss_memory_is_a_category_of_its_own(make_config):
    plain_fwd, plain_bwd, independent = _measured_step(make_config(192, loss_chunk_rows=0))
    # what the loss saves is counted apart from the model's activations, exactly
    assert plain_fwd["cat_loss_saved_bytes"] == independent
    map_bytes = 192 * 224 * 4
    assert independent > 8 * map_bytes  # pytorch-msssim keeps many full maps
    assert plain_fwd["saved_bytes"] == plain_fwd["cat_saved_bytes"]  # the model's alone
    assert plain_fwd["loss_peak_bytes"] >= independent
    assert plain_bwd["loss_peak_bytes"] > 0
    total = sum(v for k, v in plain_fwd.items() if k.startswith("cat_"))
    assert total == plain_fwd["tensor_held_bytes"] + plain_fwd["tensor_start_bytes"]


def test_chunked_loss_saves_and_peaks_far_less(make_config):
    plain_fwd, plain_bwd, _ = _measured_step(make_config(192, loss_chunk_rows=0))
    # blocks of 16 rows (+10 halo): an eighth of the image, as 256 rows are of 2048 px (its
    # forward now holds one block's autograd graph besides the gradient maps)
    fwd, bwd, independent = _measured_step(make_config(192, loss_chunk_rows=16))
    map_bytes = 192 * 224 * 4
    # the gradient maps of the prediction's pyramid (4/3 of a map: 192x224 + 96x112 + ... px)
    # and the target, which the blocks saved while they ran and the batch keeps alive
    pyramid = sum((192 >> k) * (224 >> k) * 4 for k in range(5))
    assert fwd["cat_loss_saved_bytes"] == independent <= pyramid + map_bytes + 64
    # pytorch-msssim keeps about a dozen maps; the chunked loss 4/3 of one (the target aside)
    assert fwd["cat_loss_saved_bytes"] < plain_fwd["cat_loss_saved_bytes"] / 5
    assert fwd["loss_peak_bytes"] < plain_fwd["loss_peak_bytes"] / 3
    # in backward the loss holds what it saved plus what its backward allocates on top
    assert (fwd["cat_loss_saved_bytes"] + bwd["loss_peak_bytes"]
            < 0.6 * (plain_fwd["cat_loss_saved_bytes"] + plain_bwd["loss_peak_bytes"]))
    # the model's own activations are the same either way
    assert fwd["cat_saved_bytes"] == plain_fwd["cat_saved_bytes"]


def _loss_peak(rows: int, shape=(1, 1, 512, 256)) -> int:
    """Peak live bytes of the chunked loss's forward + backward (tensor meter), inputs excluded."""
    from memstudy.meters.tensor import LiveTensorMeter

    x, y = _pair(shape)
    x, y = x.detach().float().requires_grad_(True), y.detach().float()
    with LiveTensorMeter() as meter:
        loss = 1 - msssim(x, y, msssim_weights(5), chunk_rows=rows)
        loss.backward()
    return meter.peak


def test_block_row_maps_bounds_the_loss_memory_per_block_row():
    """auto_chunk_rows sizes a block with BLOCK_ROW_MAPS float32 maps per block row: the loss's
    peak grows by at most that per added row (the slope between two block heights), and the
    bound is not loose by more than 4x (it would then waste the memory it is meant to use)."""
    from memstudy.quality import BLOCK_ROW_MAPS

    width = 256
    slope = (_loss_peak(256) - _loss_peak(64)) / (256 - 64)
    row_bytes = 4 * width
    assert slope <= BLOCK_ROW_MAPS * row_bytes, slope / row_bytes
    assert slope >= BLOCK_ROW_MAPS * row_bytes / 4, slope / row_bytes


def test_auto_rows_follow_the_memory_left(monkeypatch):
    """loss_chunk_rows = auto on CUDA: the block height is what fits AUTO_SHARE of the memory left
    under the allocator's cap (mocked allocator: no GPU needed), a multiple of the grain, at most
    the image's rows; on the CPU the fixed LOSS_CHUNK_ROWS."""
    import memstudy.quality as q

    total, cap_fraction = 80 * 2**30, 0.05
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i=None: cap_fraction)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=None: type("P", (), {"total_memory": total})())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    out = SimpleNamespace(device=torch.device("cuda", 0), shape=(1, 1, 4188, 4188))  # read only
    for allocated in (0, 2 * 2**30, int(total * cap_fraction)):
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i=None, a=allocated: a)
        left = (total * cap_fraction - allocated) * q.AUTO_SHARE
        want = int(left // (q.BLOCK_ROW_MAPS * 4 * 4188)) // q.AUTO_ROWS_GRAIN * q.AUTO_ROWS_GRAIN
        want = max(q.AUTO_ROWS_GRAIN, min(want, 4224))
        assert q.auto_chunk_rows(out) == want
    assert q.auto_chunk_rows(torch.empty(1, 1, 300, 300)) == q.LOSS_CHUNK_ROWS
