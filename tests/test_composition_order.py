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


# -- what build_pipeline sets besides the techniques ---------------------------------------
@pytest.mark.parametrize("name, cls, extra", [
    ("sgd", "SGD", {"momentum": 0.9}), ("adam", "Adam", {}), ("adamw", "AdamW", {})])
def test_the_default_optimizer_is_train_optimizer_over_the_trained_parameters(name, cls, extra):
    import torch

    from conftest import small_config

    from memstudy.techniques.compose import default_optimizer

    cfg = small_config(64)
    cfg.train.optimizer, cfg.train.lr, cfg.train.weight_decay = name, 0.25, 0.125
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)  # frozen: not the optimizer's
    opt = default_optimizer(cfg)(model)
    assert type(opt) is getattr(torch.optim, cls)
    (group,) = opt.param_groups
    assert [id(p) for p in group["params"]] == [id(model[0].bias), id(model[1].weight),
                                                 id(model[1].bias)]
    assert {k: group[k] for k in ("lr", "weight_decay", *extra)} == {
        "lr": 0.25, "weight_decay": 0.125, **extra}


def test_every_build_resets_the_process_wide_numerics():
    """A run never inherits an earlier run's TF32 or cuDNN autotuning settings."""
    import torch

    from conftest import small_config

    from memstudy.techniques import compose

    backends = (torch.backends.cuda.matmul, torch.backends.cudnn)
    saved = ([b.allow_tf32 for b in backends], torch.get_float32_matmul_precision(),
             torch.backends.cudnn.benchmark)
    try:
        for benchmark in (True, False):
            for b in backends:
                b.allow_tf32 = True
            torch.set_float32_matmul_precision("medium")
            torch.backends.cudnn.benchmark = not benchmark
            plan = compose.make_plan(small_config(192))
            plan.config.train.cudnn_benchmark = benchmark  # as a CUDA plan would have it
            compose.build_pipeline(plan)
            assert [b.allow_tf32 for b in backends] == [False, False]
            assert torch.get_float32_matmul_precision() == "highest"
            assert torch.backends.cudnn.benchmark is benchmark
    finally:
        for b, allowed in zip(backends, saved[0]):
            b.allow_tf32 = allowed
        torch.set_float32_matmul_precision(saved[1])
        torch.backends.cudnn.benchmark = saved[2]


def test_prepare_process_runs_each_process_setting_with_its_options():
    import torch

    from memstudy.techniques import compose, get_technique
    from memstudy.techniques.base import Plan

    calls = []
    techniques = {
        "first": dataclasses.replace(get_technique("checkpoint"), name="first",
                                     prepare=lambda o, p: calls.append(("first", o, p))),
        "plain": get_technique("accumulate"),  # no process setting
        "last": dataclasses.replace(get_technique("checkpoint"), name="last",
                                    prepare=lambda o, p: calls.append(("last", o, p))),
    }
    plan = Plan(config=None, device=torch.device("cpu"), n_gpus=0,
                chosen={"first": "o1", "plain": "o2", "last": "o3"}, techniques=techniques)
    compose.prepare_process(plan)
    assert calls == [("first", "o1", plan), ("last", "o3", plan)]


def test_the_loss_rows_are_recorded_as_their_least_and_most():
    from types import SimpleNamespace

    from memstudy.techniques.compose import _loss_rows

    assert _loss_rows(SimpleNamespace(rows_used={64, 16, 32}), 3) == [
        (3, 0, "loss_chunk_rows_min", 16.0), (3, 0, "loss_chunk_rows_max", 64.0)]
    assert _loss_rows(SimpleNamespace(rows_used=set()), 0) == []  # unchunked: no rows
