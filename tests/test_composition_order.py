"""The application order of canonical technique sets, pinned.

compose.py applies techniques by (stage, declared order, name), whatever order the user wrote
them in; that order is what every run records (`config.techniques`) and hashes. Swapping two
stages, or two techniques' declared orders, changes what is measured: these tests name the
expected order for a few sets that mix stages, so such a change fails here by name."""
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


@pytest.mark.parametrize("written, applied", [SETS[0], SETS[5]])
def test_the_pipeline_applies_in_the_recorded_order(written, applied, monkeypatch):
    """build_pipeline calls each technique's apply in the recorded order (CPU, no training)."""
    from conftest import small_config

    from memstudy.techniques import compose

    calls: list[str] = []
    real = compose.get_technique

    def spying(name):
        tech = real(name)

        def apply(options, build, _apply=tech.apply, _name=name):
            calls.append(_name)
            _apply(options, build)

        return dataclasses.replace(tech, apply=apply)

    cfg = small_config(192, techniques=written)
    plan = compose.make_plan(cfg)
    monkeypatch.setattr(compose, "get_technique", spying)
    compose.build_pipeline(plan)
    assert calls == applied
