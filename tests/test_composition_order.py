"""The application order of canonical technique sets, pinned.

compose.py applies techniques by (stage, declared order, name), whatever order the user wrote
them in; that order is what every run records (`config.techniques`) and hashes. Swapping two
stages, or two techniques' declared orders, changes what is measured: these tests name the
expected order for a few sets that mix stages, so such a change fails here by name, and where
build_pipeline moves the model to its device among them (after the structural techniques)."""
from __future__ import annotations

import dataclasses

import pytest

from memstudy.techniques import canonical
from memstudy.techniques.base import Stage

SETS = [
    (["accumulate:2", "checkpoint", "invertible", "amp:bf16"],
     ["invertible", "checkpoint", "amp", "accumulate"]),
    (["offload", "compress", "checkpoint", "amp:bf16", "allocator:expandable_segments=true"],
     ["allocator", "checkpoint", "compress", "offload", "amp"]),
    (["tile:4", "offload:which=boundaries", "amp:bf16", "checkpoint"],
     ["checkpoint", "tile", "offload", "amp"]),
    (["accumulate:2", "compress:bits=8", "quantization", "lowrank"],
     ["quantization", "lowrank", "compress", "accumulate"]),
    (["zero", "amp:bf16", "dp", "checkpoint:sqrt"],
     ["checkpoint", "dp", "zero", "amp"]),
    (["accumulate:2", "compress:bits=8", "tile:4", "invertible"],
     ["invertible", "compress", "tile", "accumulate"]),
    (["offload_optim", "daso", "amp:bf16", "offload:which=boundaries", "checkpoint"],
     ["checkpoint", "offload", "offload_optim", "daso", "amp"]),
]


def names(specs: list[str]) -> list[str]:
    return [spec.split(":")[0] for spec in specs]


def test_the_stages_keep_their_order():
    assert [s.name for s in sorted(Stage)] == ["PROCESS", "STRUCTURE", "ACTIVATION", "COMPILE",
                                               "PARALLEL", "RUNTIME"]


@pytest.mark.parametrize("written, applied", SETS)
def test_the_recorded_order_is_pinned_whatever_the_written_order(written, applied):
    assert names(canonical(written)) == applied
    assert names(canonical(list(reversed(written)))) == applied


def test_the_recorded_form_spells_every_option():
    assert canonical(["amp:bf16", "checkpoint"]) == [
        "checkpoint:placement=block:segments=0", "amp:dtype=bf16:init_scale=65536.0"]


def _placed_after(applied: list[str], last_structural: str | None) -> list[str]:
    """`applied` with the move to the device ("place") after the last structural technique."""
    at = applied.index(last_structural) + 1 if last_structural else 0
    return [*applied[:at], "place", *applied[at:]]


@pytest.mark.parametrize("written, applied", [
    (SETS[0][0], _placed_after(SETS[0][1], "invertible")),
    (["accumulate:2", "checkpoint"], ["place", "checkpoint", "accumulate"]),
    (SETS[5][0], _placed_after(SETS[5][1], "invertible")),
    (["invertible"], ["invertible", "place"]),  # structural only: placed after it
    ([], ["place"]),
])
def test_the_pipeline_applies_in_the_recorded_order(written, applied, monkeypatch):
    """build_pipeline calls each technique's apply in the recorded order (CPU, no training),
    and moves the model to its device once, after the structural techniques (they build on
    the model where it was made, and may place it themselves) and before the rest (which act
    on the placed model): each apply sees `build.placed` as that order says."""
    from conftest import small_config

    from memstudy.techniques import compose

    calls: list[str] = []
    placed_when_applied: list[bool] = []
    real, real_place = compose.get_technique, compose._place

    def spying(name):
        tech = real(name)

        def apply(options, build, _apply=tech.apply, _name=name):
            calls.append(_name)
            placed_when_applied.append(build.placed)
            _apply(options, build)

        return dataclasses.replace(tech, apply=apply)

    def place(build):
        calls.append("place")
        real_place(build)

    cfg = small_config(192, techniques=written)
    plan = compose.make_plan(cfg)
    monkeypatch.setattr(compose, "get_technique", spying)
    monkeypatch.setattr(compose, "_place", place)
    build = compose.build_pipeline(plan)
    assert calls == applied
    assert placed_when_applied == [calls.index(n) > calls.index("place")
                                   for n in calls if n != "place"]
    assert build.placed
