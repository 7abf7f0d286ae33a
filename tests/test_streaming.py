"""memstudy/streaming.py and the sweeps' use of it: with tile:ahead=true a host boundary's strips
for the next tile are copied in while a tile computes, on side streams (one each way) ordered
with the kernels by events; a host input's gradient is written as the tiles come.

CPU: the order in which a sweep starts and hands out its tiles' strips, and the traffic
counters. GPU: each ordering the side streams rely on, made visible by delaying one stream
with a sleeping kernel (a copy that did not wait would read or write the wrong bytes)."""
from __future__ import annotations

import pytest
import torch

from memstudy import streaming
from memstudy.tiling import sweep as sweep_module
from memstudy.tiling.geometry import Tile


class _Region:
    input_factors = [1]

    def inputs_read(self, target):
        return None


class _Sweep:
    """What tile_strips reads of a Sweep."""

    def __init__(self, n: int):
        self.region = _Region()
        self.tiles = [Tile(own=(4 * i, 4 * i + 4), strip=(4 * i, 4 * i + 4)) for i in range(n)]
        self.device = None
        self.ahead = True


def test_the_next_tiles_strips_are_started_before_a_tile_is_handed_out(monkeypatch):
    """tile_strips: tile i + 1's fetches start before tile i goes to the caller, so its
    copies run while tile i computes; every tile comes once, in order, with its own rows."""
    events = []
    started = sweep_module.fetch_strips

    def recording(region, tile, inputs, device, side=True, reads=None):
        events.append(("start", tile.strip[0] // 4))
        return started(region, tile, inputs, device, side, reads)

    monkeypatch.setattr(sweep_module, "fetch_strips", recording)
    x = torch.arange(16.0).reshape(1, 1, 16, 1)
    handed = []
    for tile, strips, rows in sweep_module.tile_strips(_Sweep(4), [x]):
        events.append(("hand", tile.strip[0] // 4))
        handed.append(strips[0].flatten().tolist())
        assert rows is None
    assert handed == [[4.0 * i + j for j in range(4)] for i in range(4)]
    for i in range(3):
        assert events.index(("start", i + 1)) < events.index(("hand", i))
    assert events.count(("hand", 3)) == 1 and ("start", 4) not in events


def test_without_ahead_each_tiles_strips_are_started_as_it_is_handed_out(monkeypatch):
    """tile:ahead=false: no tile's fetches start before the tile before it was handed out
    (the copies then run on the compute stream, one tile's strips at a time)."""
    events = []
    started = sweep_module.fetch_strips

    def recording(region, tile, inputs, device, side=True, reads=None):
        events.append(("start", tile.strip[0] // 4, side))
        return started(region, tile, inputs, device, side, reads)

    monkeypatch.setattr(sweep_module, "fetch_strips", recording)
    sw = _Sweep(3)
    sw.ahead = False
    for tile, _strips, _rows in sweep_module.tile_strips(sw, [torch.zeros(1, 1, 12, 1)]):
        events.append(("hand", tile.strip[0] // 4))
    assert events == [("start", 0, False), ("hand", 0), ("start", 1, False), ("hand", 1),
                      ("start", 2, False), ("hand", 2)]


def test_a_seeds_rows_come_with_their_tiles_strips():
    """With a seed, each tile also gets its owned rows of grad_out, at grad_out's factor over
    the coarse grid (here 2: 8 rows of grad_out per 4 coarse rows)."""
    x = torch.zeros(1, 1, 8, 1)
    grad_out = torch.arange(16.0).reshape(1, 1, 16, 1)
    sw = _Sweep(2)
    got = [rows.flatten().tolist() for _t, _s, rows in
           sweep_module.tile_strips(sw, [x], seed=sweep_module.Seed(grad_out))]
    assert got == [list(map(float, range(8))), list(map(float, range(8, 16)))]


def test_traffic_take_returns_the_counts_and_starts_again():
    traffic = streaming.Traffic(h2d_bytes=10, d2h_bytes=3)
    assert traffic.take() == (10, 3)
    assert traffic.take() == (0, 0)


def test_a_tensor_already_where_it_is_asked_for_is_not_copied():
    t = torch.ones(2, 3)
    assert streaming.fetch(t, None).get() is t
    assert streaming.on_device(t, torch.device("cpu")) is t
    streaming.settle(torch.device("cpu"))  # nothing issued: nothing to wait for


_SLEEP = 200_000_000  # GPU cycles: about 0.1 s, far longer than the copies below


@pytest.mark.gpu
def test_a_fetched_strip_is_read_only_after_its_copy_lands():
    """The stream in is held back by a sleeping kernel; the compute stream reads the fetched
    tensor at once and must still see the host's values (get() waits for the copy's event)."""
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    side = streaming._side_stream(torch.device("cuda"), "in")
    with torch.cuda.stream(side):
        torch.cuda._sleep(_SLEEP)
    read = streaming.fetch(host, torch.device("cuda"), side=True).get().clone()
    torch.cuda.current_stream().synchronize()
    streaming.settle(torch.device("cuda"))
    assert torch.equal(read.cpu(), host)


@pytest.mark.gpu
def test_written_rows_are_the_kernels_values_once_settled():
    """write_rows copies only after the kernels that make `part` (the compute stream sleeps
    before filling it), and settle makes the compute stream wait for the copy: synchronising
    the compute stream alone then shows the host rows written."""
    host = torch.zeros(4, 1 << 18).pin_memory()
    part = torch.zeros(2, 1 << 18, device="cuda")
    torch.cuda._sleep(_SLEEP)
    part.fill_(7.0)
    streaming.write_rows(host[1:3], part, side=True)
    del part  # its memory must not be reused before the copy (record_stream)
    torch.zeros(2, 1 << 18, device="cuda").fill_(-1.0)
    streaming.settle(torch.device("cuda"))
    torch.cuda.current_stream().synchronize()
    assert torch.all(host[1:3] == 7.0) and torch.all(host[0] == 0) and torch.all(host[3] == 0)


@pytest.mark.gpu
def test_added_rows_are_read_after_the_writes_before_them():
    """The copies to the host run on a stream of their own: rows written there (held back by a
    sleeping kernel) and then read back to be added to (add_rows) are read only once written,
    so the sum holds both additions (1 + 2 + 3 where they overlap)."""
    device = torch.device("cuda")
    host = torch.ones(1, 1, 6, 1 << 16).pin_memory()
    with torch.cuda.stream(streaming._side_stream(device, "out")):
        torch.cuda._sleep(_SLEEP)
    streaming.write_rows(host[..., 0:4, :], torch.full((1, 1, 4, 1 << 16), 3.0, device=device),
                         side=True)
    streaming.add_rows(host, 2, 6, torch.full((1, 1, 4, 1 << 16), 2.0, device=device),
                       side=True)
    streaming.settle(device)
    torch.cuda.current_stream().synchronize()
    rows = host[0, 0, :, 0].tolist()
    assert rows == [3.0, 3.0, 5.0, 5.0, 3.0, 3.0]


def _unfilled(shape, dtype, device, memory_format=torch.contiguous_format):
    """host_empty whose rows are NaN, so that a row nothing wrote cannot pass for zero."""
    return torch.full(shape, float("nan"), dtype=dtype)


def test_a_host_input_gradient_is_written_as_the_tiles_come(monkeypatch):
    """Sweep.add_input_grad: rows nothing wrote are written (no zero fill, nothing read back),
    rows the strip before wrote are added to, rows no strip reached are zero, and a later
    Function adds to all of them: the sums a zero-filled buffer would hold."""
    monkeypatch.setattr(sweep_module, "host_empty", _unfilled)
    sw = sweep_module.Sweep(_Region(), [], ("cpu", False, torch.float32))
    sw.pending[0] = 2  # two Functions add into input 0
    like = torch.zeros(1, 1, 10, 2)

    def rows(n: int, value: float) -> torch.Tensor:
        return torch.full((1, 1, n, 2), value)

    sw.add_input_grad(0, like, 0, 4, rows(4, 1.0))   # rows 0-3 written
    sw.add_input_grad(0, like, 2, 6, rows(4, 2.0))   # rows 2-3 added to, 4-5 written
    sw.add_input_grad(0, like, 7, 9, rows(2, 5.0))   # row 6 reached by no strip: zero
    assert sw.settle(0) is None
    sw.add_input_grad(0, like, 0, 10, rows(10, 1.0))  # the next Function: row 9 still unwritten
    grad = sw.settle(0)
    expected = torch.tensor([2, 2, 4, 4, 3, 3, 1, 6, 6, 1.0]).view(1, 1, 10, 1).expand(1, 1, 10, 2)
    assert torch.equal(grad, expected)


def test_rows_below_the_last_strip_with_a_gradient_are_zero_when_the_sum_is_handed_on(monkeypatch):
    monkeypatch.setattr(sweep_module, "host_empty", _unfilled)
    sw = sweep_module.Sweep(_Region(), [], ("cpu", False, torch.float32))
    sw.pending[0] = 1
    sw.add_input_grad(0, torch.zeros(1, 1, 6, 1), 0, 3, torch.ones(1, 1, 3, 1))
    assert torch.equal(sw.settle(0).flatten(), torch.tensor([1, 1, 1, 0, 0, 0.0]))


def test_a_statistics_sweep_copies_in_only_the_inputs_it_reads(monkeypatch):
    """Region layer1.0 at levels=4 with layer1=convs takes a0 (its first convolution's output)
    and p0 (its input, the identity added after bn2). The sweeps for bn2's statistics, forward
    and backward, stop at bn2's input, so they copy in a0's strips alone; its apply sweeps copy
    in both. The step's values are unchanged (tests/test_tiling.py compares streamed plans with
    the untiled step in float64)."""
    from memstudy.models import build_unet
    from memstudy.tiling.tiled_forward import TiledForward

    real_tile_strips, real_fetch = sweep_module.tile_strips, sweep_module.fetch
    now: dict = {}
    fetched: set = set()

    def tile_strips(sweep, inputs, tiles=None, seed=None, target=None):
        now.update(region=sweep.region.name, target=target,
                   inputs={x.untyped_storage().data_ptr(): i for i, x in enumerate(inputs)})
        yield from real_tile_strips(sweep, inputs, tiles, seed, target)

    def fetch(t, device, side=False, after_writes=False):
        i = now.get("inputs", {}).get(t.untyped_storage().data_ptr())
        if i is not None and now["region"] == "layer1.0":
            fetched.add((now["target"], i))
        return real_fetch(t, device, side, after_writes)

    monkeypatch.setattr(sweep_module, "tile_strips", tile_strips)
    monkeypatch.setattr(sweep_module, "fetch", fetch)
    torch.manual_seed(0)
    unet = build_unet(seed=0).train()
    unet.forward_padded = TiledForward(unet, 4, 0, 64, "conv1", None, "convs", "torch",
                                       stream=True)
    unet(torch.rand(1, 1, 256, 64)).square().mean().backward()
    bn2 = unet.forward_padded.regions["layer1.0"].norm_names.index("layer1.0.bn2")
    assert fetched == {(None, 0), (None, 1), (bn2, 0)}
