"""Tile region inputs brought back by rows (memstudy/runtime.py RowArrivals, offload.py
ArrivingRows): the sweeps' backward unpacks its inputs as a row reader and waits for each
strip's rows before reading them, top to bottom; every other unpack waits for the whole tensor.
Checked on the CPU with stand-in events and streams (the chunked copies themselves need a GPU:
tests/test_tile_fast_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from memstudy.models import build_unet
from memstudy.runtime import ROWS_IN, RowArrivals, read_by_rows
from memstudy.techniques import offload
from memstudy.tiling.tiled_forward import TiledForward


class FakeEvent:
    def __init__(self, name: str, done: bool = True):
        self.name, self.finished = name, done

    def query(self) -> bool:
        return self.finished


class FakeStream:
    def __init__(self):
        self.waited: list[str] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event.name)


class Needs:
    """CopyTimes' side of it: which chunks were needed (exposure counted) or covered."""

    def __init__(self):
        self.needed, self.covered = [], []

    def needed_(self, event, stream):
        self.needed.append(event.name)

    def covered_(self, event):
        self.covered.append(event.name)


@pytest.fixture
def stream(monkeypatch):
    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    return stream


def _arriving(ends, done=True):
    needs = Needs()
    times = type("T", (), {"needed": needs.needed_, "covered": needs.covered_})()
    events = [FakeEvent(f"c{i}", done) for i in range(len(ends))]
    return offload.ArrivingRows(ends, events, times, torch.device("cpu")), needs


def test_row_chunks_partition_the_rows():
    assert offload.row_chunk_ends(4192, 16)[-1] == 4192
    assert offload.row_chunk_ends(100, 3) == [33, 66, 100]
    assert offload.row_chunk_ends(5, 16) == [1, 2, 3, 4, 5]  # no empty chunk
    assert offload.row_chunk_ends(7, 0) == [7]


def test_only_layouts_whose_rows_are_one_block_per_image_come_back_by_rows():
    assert offload._rows_dense(torch.empty(2, 16, 8, 8).to(memory_format=torch.channels_last))
    assert offload._rows_dense(torch.empty(1, 1, 8, 8))
    assert not offload._rows_dense(torch.empty(1, 16, 8, 8))  # NCHW: a block per channel
    assert not offload._rows_dense(torch.empty(16, 8, 8))


def test_a_strip_waits_for_the_last_chunk_it_reads_once(stream):
    rows, needs = _arriving([8, 16, 24, 32])
    rows.wait(0, 10)  # rows 0:10 lie in chunks 0 and 1: waiting for 1 covers 0
    rows.wait(4, 12)  # already waited for
    rows.wait(12, 30)
    assert stream.waited == ["c1", "c3"]
    assert needs.needed == ["c1", "c3"] and needs.covered == ["c0", "c2"]
    assert rows.all_waited
    rows.wait(0, 32)  # nothing left to wait for
    assert stream.waited == ["c1", "c3"]


def test_waiting_for_the_whole_height_waits_for_the_last_chunk(stream):
    rows, needs = _arriving([8, 16])
    assert not rows.all_waited
    rows.wait(0, 16)
    assert stream.waited == ["c1"] and needs.covered == ["c0"] and rows.all_waited


def test_the_registry_finds_a_tensor_by_its_storage_and_forgets_landed_copies(stream):
    arrivals = RowArrivals()
    t, other = torch.zeros(1, 1, 32, 4), torch.zeros(1, 1, 32, 4)
    rows, _ = _arriving([16, 32], done=False)
    arrivals.arriving(t, rows)
    arrivals.await_rows(other, 0, 32)  # another tensor: nothing to wait for
    assert stream.waited == []
    arrivals.await_rows(t.detach(), 0, 8)  # autograd may hand out a new object, same storage
    assert stream.waited == ["c0"]
    landed, _ = _arriving([32])
    arrivals.arriving(other, landed)  # t's copy still in flight: kept
    assert len(arrivals._pending) == 2
    rows.copied[-1].finished = True
    arrivals.arriving(torch.zeros(1), _arriving([1], done=False)[0])
    assert len(arrivals._pending) == 1  # both landed copies forgotten


def test_a_tensor_whose_last_chunk_was_waited_for_leaves_the_registry(stream):
    arrivals = RowArrivals()
    t = torch.zeros(1, 1, 32, 4)
    arrivals.arriving(t, _arriving([16, 32], done=False)[0])
    arrivals.await_rows(t, 0, 16)
    assert len(arrivals._pending) == 1  # rows 16:32 still to come
    arrivals.await_rows(t, 16, 32)
    assert not arrivals._pending and stream.waited == ["c0", "c1"]


def test_the_sweeps_backward_reads_its_inputs_by_rows_strip_by_strip_top_to_bottom(monkeypatch):
    """A tiled U-Net on the CPU under a saved-tensor hook pair standing in for offload: every
    tile region input is marked to be read by rows, is unpacked by the sweeps' backward inside
    `by_rows`, and each of its tiles waits for its strip's rows before reading them, in order."""
    waits: dict[int, list[tuple[int, int]]] = {}
    unpacks = {"by_rows": 0, "whole": 0}

    class Recorder:
        def __init__(self, key):
            self.key = key

        def wait(self, lo, hi):
            waits.setdefault(self.key, []).append((lo, hi))

        def done(self):
            return False

        all_waited = False  # kept registered: every sweep's waits are recorded

    marked = []

    def pack(t):
        if read_by_rows(t):
            marked.append(t.shape)
        return t

    def unpack(t):
        if read_by_rows(t):
            unpacks["by_rows" if ROWS_IN.wanted else "whole"] += 1
            if ROWS_IN.wanted:
                ROWS_IN.arriving(t, Recorder(len(waits) + len(ROWS_IN._pending)))
        return t

    model = build_unet(seed=0)
    model.forward_padded = TiledForward(model, 2, tiles=3, keep="all")
    x = torch.rand(1, 1, 192, 160, generator=torch.Generator().manual_seed(0))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = model(x)
        out.square().mean().backward()
    finally:
        ROWS_IN._pending.clear()
    assert marked, "no tile region input was marked to be read by rows"
    # an input some untiled op saves too (the image, a skip connection) is unpacked whole there
    assert unpacks["by_rows"] > unpacks["whole"]
    assert waits
    for strips in waits.values():
        # each backward sweep of the region: its 3 tiles' strips, top to bottom, to the last row
        assert len(strips) % 3 == 0
        for sweep in range(0, len(strips), 3):
            tiles = strips[sweep:sweep + 3]
            assert [lo for lo, _ in tiles] == sorted(lo for lo, _ in tiles)
            assert tiles[-1][1] == max(hi for _, hi in strips)
