"""Every registered technique, and every pair of them, either trains one step or is refused
before anything is built with a ConfigError that names what to change (timm-style registry test)."""
from __future__ import annotations

import itertools

import pytest

from memstudy.errors import ConfigError
from memstudy.runner import execute
from memstudy.techniques import get_technique, list_techniques

NAMES = [t.name for t in list_techniques()]
# CPU-runnable variants of techniques whose default options are GPU-only (amp's default is fp16)
SPECS = NAMES + ["amp:bf16", "checkpoint:sqrt", "checkpoint:selective"]
PAIRS = [(a, b) for a, b in itertools.combinations(SPECS, 2) if a.split(":")[0] != b.split(":")[0]]


def one_step(make_config, techniques: list[str]) -> str:
    cfg = make_config(192, techniques=techniques, warmup_steps=0, measure_steps=1,
                      max_steps=1, validate=False)
    cfg.data.train_images, cfg.data.val_images = 1, 1
    cfg.meter.tensor = "off"
    try:
        rec = execute(cfg, db=None)
    except ConfigError as exc:
        message = str(exc)
        # a refusal names a setting or option to change, or a technique of the combination
        names = [t.split(":")[0] for t in techniques]
        settings = ("train.", "data.", "world_size", "budget", "=")
        assert any(word in message for word in (*names, *settings)), message
        return "refused"
    assert rec.status == "ok", (techniques, rec.failed_phase, rec.error)
    return rec.status


def test_registry_lists_every_stage_and_unknown_names_list_the_valid_ones():
    assert {"amp", "checkpoint", "invertible", "quantization", "offload", "dp", "zero", "fsdp",
            "mp", "pipeline", "tri_accel"} <= set(NAMES)
    with pytest.raises(ConfigError, match="valid: .*amp"):
        get_technique("nope")


@pytest.mark.parametrize("spec", SPECS)
def test_every_technique_trains_a_step_or_is_refused(make_config, spec):
    one_step(make_config, [spec])


@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_every_pair_trains_a_step_or_is_refused(make_config, pair):
    one_step(make_config, list(pair))


def test_the_cpu_runnable_study_combinations_train(make_config):
    for techniques in (["amp:bf16", "checkpoint"], ["checkpoint", "invertible"],
                       ["amp:bf16", "quantization"], ["amp:bf16", "checkpoint", "invertible"]):
        assert one_step(make_config, techniques) == "ok", techniques
