"""Offload's copy timing (memstudy/techniques/offload.py, CopyTimes) keeps a bounded number of
CUDA events over a long run and sums them exactly: checked on the CPU with stand-in events that
hold a time stamp (the class only calls `record`, `query` and `elapsed_time`)."""
from __future__ import annotations

import itertools

import pytest

from memstudy.techniques import offload

CLOCK = itertools.count()


class FakeEvent:
    """A finished event at the next tick of a shared clock (ms)."""

    def __init__(self, done: bool = True):
        self.at, self.done = float(next(CLOCK)), done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, later: "FakeEvent") -> float:
        return later.at - self.at


@pytest.fixture
def times(monkeypatch):
    monkeypatch.setattr(offload.CopyTimes, "start", staticmethod(lambda stream: FakeEvent()))
    return offload.CopyTimes()


def test_on_demand_copies_fold_into_bounded_sums(times):
    for _ in range(10 * offload.CopyTimes.FOLD_AT):
        with times.on_demand(None):
            pass  # each copy: start at t, end at t + 1
    assert len(times._on_demand) < offload.CopyTimes.FOLD_AT
    total = 10 * offload.CopyTimes.FOLD_AT
    assert times.totals() == {"h2d_copy_ms": float(total), "h2d_exposed_ms": float(total)}


def test_prefetched_copies_count_their_exposure_and_unneeded_ones_only_at_the_end(times):
    n = 3 * offload.CopyTimes.FOLD_AT
    for i in range(n):
        started, copied = FakeEvent(), FakeEvent()  # each copy takes 1 ms
        times.prefetched(started, copied)
        if i % 2 == 0:  # needed 1 ms before the copy ended: 1 ms exposed
            need = FakeEvent()
            need.at = copied.at - 1
            times._prefetched[id(copied)][2] = need
    # needed pairs are folded as copies accumulate; unneeded ones wait for the end
    assert len(times._prefetched) <= n // 2 + offload.CopyTimes.FOLD_AT
    assert times.totals() == {"h2d_copy_ms": float(n), "h2d_exposed_ms": float(n // 2)}
    assert not times._prefetched


def test_unfinished_pairs_are_kept_not_counted(times):
    started, copied = FakeEvent(), FakeEvent(done=False)
    times.prefetched(started, copied)
    assert times.totals() == {"h2d_copy_ms": 0.0, "h2d_exposed_ms": 0.0}
    copied.done = True
    assert times.totals() == {"h2d_copy_ms": 1.0, "h2d_exposed_ms": 0.0}
