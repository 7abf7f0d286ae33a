"""What every technique, and every pair of techniques, does on the CPU: an explicit table.

Each entry is OK (make_plan accepts the combination, and two optimizer steps train through the
real run path, runner.execute, to a finite loss) or the refusal's first clause, exactly (make_plan
raises a ConfigError whose first clause, `plan_outcome`, is that text, before anything is
built). So a technique that starts refusing, refuses for another reason, or is refused by
another technique's check first, or stops training fails here, and a new technique fails
`test_the_table_has_a_row_for_every_technique_and_pair` until its rows are added. To add them,
`python -c "import sys; sys.path.insert(0, 'tests'); import test_registry as t; t._print_table()"`
prints the current outcomes in this format; read each refusal before pasting it (it is what a
user will be told).

All entries share one tiny configuration (`tiny_config`: 64 px, one MS-SSIM scale, SGD, one
warm-up and one measured step, no validation) with world_size 1 on the CPU; distributed
combinations on GPUs are planned in tests/test_distributed.py.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from memstudy.config import RunConfig
from memstudy.errors import ConfigError
from memstudy.network import ENCODERS, ModelConfig
from memstudy.grid import config_hash
from memstudy.runner import execute
from memstudy.techniques import canonical, composition_key, get_technique, list_techniques
from memstudy.techniques.base import Stage
from memstudy.techniques.compose import make_plan

OK = "ok"
# the defaults of these need a GPU; the table uses their CPU-runnable form
CPU_SPEC = {"amp": "amp:bf16", "tri_accel": "tri_accel:low=bf16:elastic=off",
            # Inductor's C++ kernels take minutes to compile on 2 cores; aot_eager traces the same
            # graphs (tests/test_tech_compile.py runs Inductor on the CPU once)
            "compile": "compile:backend=aot_eager"}
DOCS = Path(__file__).resolve().parents[1] / "docs" / "techniques"


def tiny_config(techniques: list[str], network: ModelConfig | None = None) -> RunConfig:
    cfg = RunConfig(techniques=list(techniques), model=network or ModelConfig())
    t = cfg.train
    t.image_size, t.device, t.msssim_scales, t.optimizer = 64, "cpu", 1, "sgd"
    t.warmup_steps, t.measure_steps, t.max_steps, t.validate = 1, 1, 2, False
    cfg.data.train_images, cfg.data.val_images = 4, 1  # 2 steps also with accumulate's k = 2
    cfg.meter.tensor = "off"
    return cfg


def plan_outcome(techniques: list[str], network: ModelConfig | None = None) -> str:
    """OK, or the refusal's first clause (up to ';', or up to ': ' when that is informative)."""
    try:
        make_plan(tiny_config(techniques, network))
        return OK
    except ConfigError as exc:
        message = str(exc).split(";")[0]
        head = message.split(": ")[0]
        return head if len(head) >= 25 else message


def check_outcome(techniques: list[str], expected: str, network: ModelConfig | None = None
                  ) -> None:
    if expected == OK:
        assert plan_outcome(techniques, network) == OK, plan_outcome(techniques, network)
        return
    with pytest.raises(ConfigError) as err:
        make_plan(tiny_config(techniques, network))
    assert plan_outcome(techniques, network) == expected, (techniques, str(err.value))


def trains(techniques: list[str], network: ModelConfig | None = None) -> None:
    rec = execute(tiny_config(techniques, network), db=None)
    assert rec.status == "ok", (techniques, rec.failed_phase, rec.error)
    losses = [v for _, _, name, v in rec.series if name == "loss"]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), losses


SPECS = [CPU_SPEC.get(t.name, t.name) for t in list_techniques()]

ALLOCATOR_REFUSED = "allocator configures PyTorch's CUDA caching allocator but train.device resolves to cpu"
MP_REFUSED = 'mp needs world_size = 2 (got 1)'
PIPELINE_REFUSED = 'pipeline:micro_batches=2 must divide train.batch_size 1'
OFFLOAD_OPTIM_REFUSED = 'offload_optim keeps the optimizer state in host memory between steps, but train.device resolves to cpu, where it already is'
OFFLOAD_REFUSED = 'offload moves tensors saved for backward from the GPU to host memory, but train.device resolves to cpu, where they already are'
DASO_REFUSED = 'daso needs world_size >= 2 processes (got 1)'
DP_REFUSED = 'dp needs train.warmup_steps >= 2 (got 1)'
FSDP_REFUSED = 'fsdp needs world_size >= 2 processes (got 1)'
ZERO_REFUSED = 'zero shards the optimizer state over data-parallel ranks and needs dp'
AB_REFUSED = 'ab trains groups of data-parallel ranks'
LOWRANK_REFUSED = 'lowrank replaces weights by trainable factors during the run'

# -- the table ------------------------------------------------------------------------------
SINGLES = {  # each technique alone
    'allocator': ALLOCATOR_REFUSED,
    'invertible': OK,
    'quantization': OK,
    'lowrank': OK,
    'mp': MP_REFUSED,
    'pipeline': PIPELINE_REFUSED,
    'checkpoint': OK,
    'compress': OK,
    'tile': OK,
    'offload': OFFLOAD_REFUSED,
    'compile:backend=aot_eager': OK,
    'daso': DASO_REFUSED,
    'dp': DP_REFUSED,
    'fsdp': FSDP_REFUSED,
    'zero': ZERO_REFUSED,
    'amp:bf16': OK,
    'tri_accel:low=bf16:elastic=off': OK,
    'accumulate': OK,
    'ab': AB_REFUSED,
    'offload_optim': OFFLOAD_OPTIM_REFUSED,
}
PAIRS = {  # every pair of SPECS, in registry (composition) order
    ('allocator', 'invertible'): ALLOCATOR_REFUSED,
    ('allocator', 'quantization'): ALLOCATOR_REFUSED,
    ('allocator', 'lowrank'): ALLOCATOR_REFUSED,
    ('allocator', 'mp'): ALLOCATOR_REFUSED,
    ('allocator', 'pipeline'): ALLOCATOR_REFUSED,
    ('allocator', 'checkpoint'): ALLOCATOR_REFUSED,
    ('allocator', 'compress'): ALLOCATOR_REFUSED,
    ('allocator', 'tile'): ALLOCATOR_REFUSED,
    ('allocator', 'offload'): ALLOCATOR_REFUSED,
    ('allocator', 'compile:backend=aot_eager'): ALLOCATOR_REFUSED,
    ('allocator', 'daso'): ALLOCATOR_REFUSED,
    ('allocator', 'dp'): ALLOCATOR_REFUSED,
    ('allocator', 'fsdp'): ALLOCATOR_REFUSED,
    ('allocator', 'zero'): ALLOCATOR_REFUSED,
    ('allocator', 'amp:bf16'): ALLOCATOR_REFUSED,
    ('allocator', 'tri_accel:low=bf16:elastic=off'): ALLOCATOR_REFUSED,
    ('allocator', 'accumulate'): ALLOCATOR_REFUSED,
    ('invertible', 'quantization'): OK,
    ('invertible', 'lowrank'): LOWRANK_REFUSED,
    ('invertible', 'mp'): MP_REFUSED,
    ('invertible', 'pipeline'): PIPELINE_REFUSED,
    ('invertible', 'checkpoint'): OK,
    ('invertible', 'compress'): OK,
    ('invertible', 'tile'): OK,
    ('invertible', 'offload'): OFFLOAD_REFUSED,
    ('invertible', 'compile:backend=aot_eager'): 'compile with invertible is not supported',
    ('invertible', 'daso'): DASO_REFUSED,
    ('invertible', 'dp'): DP_REFUSED,
    ('invertible', 'fsdp'): FSDP_REFUSED,
    ('invertible', 'zero'): ZERO_REFUSED,
    ('invertible', 'amp:bf16'): OK,
    ('invertible', 'tri_accel:low=bf16:elastic=off'): OK,
    ('invertible', 'accumulate'): OK,
    ('quantization', 'lowrank'): LOWRANK_REFUSED,
    ('quantization', 'mp'): MP_REFUSED,
    ('quantization', 'pipeline'): PIPELINE_REFUSED,
    ('quantization', 'checkpoint'): OK,
    ('quantization', 'compress'): 'compress cannot be combined with quantization',
    ('quantization', 'tile'): 'tile cannot compose with quantization',
    ('quantization', 'offload'): OFFLOAD_REFUSED,
    ('quantization', 'compile:backend=aot_eager'): 'compile with quantization is not supported',
    ('quantization', 'daso'): DASO_REFUSED,
    ('quantization', 'dp'): DP_REFUSED,
    ('quantization', 'fsdp'): FSDP_REFUSED,
    ('quantization', 'zero'): ZERO_REFUSED,
    ('quantization', 'amp:bf16'): OK,
    ('quantization', 'tri_accel:low=bf16:elastic=off'): OK,
    ('quantization', 'accumulate'): OK,
    ('lowrank', 'mp'): LOWRANK_REFUSED,
    ('lowrank', 'pipeline'): LOWRANK_REFUSED,
    ('lowrank', 'checkpoint'): OK,
    ('lowrank', 'compress'): LOWRANK_REFUSED,
    ('lowrank', 'tile'): LOWRANK_REFUSED,
    ('lowrank', 'offload'): OFFLOAD_REFUSED,
    ('lowrank', 'compile:backend=aot_eager'): LOWRANK_REFUSED,
    ('lowrank', 'daso'): LOWRANK_REFUSED,
    ('lowrank', 'dp'): LOWRANK_REFUSED,
    ('lowrank', 'fsdp'): LOWRANK_REFUSED,
    ('lowrank', 'zero'): LOWRANK_REFUSED,
    ('lowrank', 'amp:bf16'): OK,
    ('lowrank', 'tri_accel:low=bf16:elastic=off'): LOWRANK_REFUSED,
    ('lowrank', 'accumulate'): LOWRANK_REFUSED,
    ('mp', 'pipeline'): MP_REFUSED,
    ('mp', 'checkpoint'): MP_REFUSED,
    ('mp', 'compress'): MP_REFUSED,
    ('mp', 'tile'): MP_REFUSED,
    ('mp', 'offload'): MP_REFUSED,
    ('mp', 'compile:backend=aot_eager'): MP_REFUSED,
    ('mp', 'daso'): MP_REFUSED,
    ('mp', 'dp'): MP_REFUSED,
    ('mp', 'fsdp'): MP_REFUSED,
    ('mp', 'zero'): MP_REFUSED,
    ('mp', 'amp:bf16'): MP_REFUSED,
    ('mp', 'tri_accel:low=bf16:elastic=off'): MP_REFUSED,
    ('mp', 'accumulate'): MP_REFUSED,
    ('pipeline', 'checkpoint'): PIPELINE_REFUSED,
    ('pipeline', 'compress'): PIPELINE_REFUSED,
    ('pipeline', 'tile'): PIPELINE_REFUSED,
    ('pipeline', 'offload'): PIPELINE_REFUSED,
    ('pipeline', 'compile:backend=aot_eager'): PIPELINE_REFUSED,
    ('pipeline', 'daso'): PIPELINE_REFUSED,
    ('pipeline', 'dp'): PIPELINE_REFUSED,
    ('pipeline', 'fsdp'): PIPELINE_REFUSED,
    ('pipeline', 'zero'): PIPELINE_REFUSED,
    ('pipeline', 'amp:bf16'): PIPELINE_REFUSED,
    ('pipeline', 'tri_accel:low=bf16:elastic=off'): PIPELINE_REFUSED,
    ('pipeline', 'accumulate'): PIPELINE_REFUSED,
    ('checkpoint', 'compress'): OK,
    ('checkpoint', 'tile'): OK,
    ('checkpoint', 'offload'): OFFLOAD_REFUSED,
    ('checkpoint', 'compile:backend=aot_eager'): OK,
    ('checkpoint', 'daso'): DASO_REFUSED,
    ('checkpoint', 'dp'): DP_REFUSED,
    ('checkpoint', 'fsdp'): FSDP_REFUSED,
    ('checkpoint', 'zero'): ZERO_REFUSED,
    ('checkpoint', 'amp:bf16'): OK,
    ('checkpoint', 'tri_accel:low=bf16:elastic=off'): OK,
    ('checkpoint', 'accumulate'): OK,
    ('compress', 'tile'): OK,
    ('compress', 'offload'): OFFLOAD_REFUSED,
    ('compress', 'compile:backend=aot_eager'): 'compress cannot be combined with compile',
    ('compress', 'daso'): DASO_REFUSED,
    ('compress', 'dp'): DP_REFUSED,
    ('compress', 'fsdp'): FSDP_REFUSED,
    ('compress', 'zero'): ZERO_REFUSED,
    ('compress', 'amp:bf16'): OK,
    ('compress', 'tri_accel:low=bf16:elastic=off'): OK,
    ('compress', 'accumulate'): OK,
    ('tile', 'offload'): OFFLOAD_REFUSED,
    ('tile', 'compile:backend=aot_eager'): OK,
    ('tile', 'daso'): DASO_REFUSED,
    ('tile', 'dp'): DP_REFUSED,
    ('tile', 'fsdp'): 'tile cannot compose with fsdp',
    ('tile', 'zero'): ZERO_REFUSED,
    ('tile', 'amp:bf16'): OK,
    ('tile', 'tri_accel:low=bf16:elastic=off'): "tile cannot compose with tri_accel:precision, "
        "which sets autocast per unit by wrapping the stem and decoder blocks' forward that tile "
        "runs piecewise",
    ('tile', 'accumulate'): OK,
    ('offload', 'compile:backend=aot_eager'): OFFLOAD_REFUSED,
    ('offload', 'daso'): OFFLOAD_REFUSED,
    ('offload', 'dp'): OFFLOAD_REFUSED,
    ('offload', 'fsdp'): OFFLOAD_REFUSED,
    ('offload', 'zero'): OFFLOAD_REFUSED,
    ('offload', 'amp:bf16'): OFFLOAD_REFUSED,
    ('offload', 'tri_accel:low=bf16:elastic=off'): OFFLOAD_REFUSED,
    ('offload', 'accumulate'): OFFLOAD_REFUSED,
    ('compile:backend=aot_eager', 'daso'): DASO_REFUSED,
    ('compile:backend=aot_eager', 'dp'): DP_REFUSED,
    ('compile:backend=aot_eager', 'fsdp'): FSDP_REFUSED,
    ('compile:backend=aot_eager', 'zero'): ZERO_REFUSED,
    ('compile:backend=aot_eager', 'amp:bf16'): OK,
    ('compile:backend=aot_eager', 'tri_accel:low=bf16:elastic=off'): 'compile with tri_accel is not supported',
    ('compile:backend=aot_eager', 'accumulate'): 'compile with accumulate is not supported',
    ('daso', 'dp'): DASO_REFUSED,
    ('daso', 'fsdp'): DASO_REFUSED,
    ('daso', 'zero'): DASO_REFUSED,
    ('daso', 'amp:bf16'): DASO_REFUSED,
    ('daso', 'tri_accel:low=bf16:elastic=off'): DASO_REFUSED,
    ('daso', 'accumulate'): DASO_REFUSED,
    ('dp', 'fsdp'): 'fsdp is itself data parallel (it shards what dp replicates)',
    ('dp', 'zero'): DP_REFUSED,
    ('dp', 'amp:bf16'): DP_REFUSED,
    ('dp', 'tri_accel:low=bf16:elastic=off'): DP_REFUSED,
    ('dp', 'accumulate'): DP_REFUSED,
    ('fsdp', 'zero'): 'fsdp with zero: fsdp already shards the optimizer state',
    ('fsdp', 'amp:bf16'): FSDP_REFUSED,
    ('fsdp', 'tri_accel:low=bf16:elastic=off'): FSDP_REFUSED,
    ('fsdp', 'accumulate'): FSDP_REFUSED,
    ('zero', 'amp:bf16'): ZERO_REFUSED,
    ('zero', 'tri_accel:low=bf16:elastic=off'): ZERO_REFUSED,
    ('zero', 'accumulate'): ZERO_REFUSED,
    ('amp:bf16', 'tri_accel:low=bf16:elastic=off'): "tri_accel sets each unit's precision itself",
    ('amp:bf16', 'accumulate'): OK,
    ('tri_accel:low=bf16:elastic=off', 'accumulate'): OK,
    ('allocator', 'ab'): ALLOCATOR_REFUSED,
    ('invertible', 'ab'): AB_REFUSED,
    ('quantization', 'ab'): AB_REFUSED,
    ('lowrank', 'ab'): LOWRANK_REFUSED,
    ('mp', 'ab'): MP_REFUSED,
    ('pipeline', 'ab'): PIPELINE_REFUSED,
    ('checkpoint', 'ab'): AB_REFUSED,
    ('compress', 'ab'): AB_REFUSED,
    ('tile', 'ab'): AB_REFUSED,
    ('offload', 'ab'): OFFLOAD_REFUSED,
    ('compile:backend=aot_eager', 'ab'): 'compile with ab is not supported',
    ('daso', 'ab'): DASO_REFUSED,
    ('dp', 'ab'): DP_REFUSED,
    ('fsdp', 'ab'): FSDP_REFUSED,
    ('zero', 'ab'): ZERO_REFUSED,
    ('amp:bf16', 'ab'): AB_REFUSED,
    ('tri_accel:low=bf16:elastic=off', 'ab'): AB_REFUSED,
    ('ab', 'accumulate'): AB_REFUSED,
    # offload_optim (PARALLEL, order 5) with each other technique
    ('allocator', 'offload_optim'): ALLOCATOR_REFUSED,
    ('invertible', 'offload_optim'): OFFLOAD_OPTIM_REFUSED,
    ('quantization', 'offload_optim'): OFFLOAD_OPTIM_REFUSED,
    ('lowrank', 'offload_optim'): LOWRANK_REFUSED,
    ('mp', 'offload_optim'): MP_REFUSED,
    ('pipeline', 'offload_optim'): PIPELINE_REFUSED,
    ('checkpoint', 'offload_optim'): OFFLOAD_OPTIM_REFUSED,
    ('compress', 'offload_optim'): OFFLOAD_OPTIM_REFUSED,
    ('tile', 'offload_optim'): OFFLOAD_OPTIM_REFUSED,
    ('offload', 'offload_optim'): OFFLOAD_REFUSED,
    ('compile:backend=aot_eager', 'offload_optim'): 'compile with offload_optim is not supported',
    ('offload_optim', 'daso'): OFFLOAD_OPTIM_REFUSED,
    ('offload_optim', 'dp'): OFFLOAD_OPTIM_REFUSED,
    ('offload_optim', 'fsdp'): OFFLOAD_OPTIM_REFUSED,
    ('offload_optim', 'zero'): OFFLOAD_OPTIM_REFUSED,
    ('offload_optim', 'amp:bf16'): OFFLOAD_OPTIM_REFUSED,
    ('offload_optim', 'tri_accel:low=bf16:elastic=off'): OFFLOAD_OPTIM_REFUSED,
    ('offload_optim', 'ab'): OFFLOAD_OPTIM_REFUSED,
    ('offload_optim', 'accumulate'): OFFLOAD_OPTIM_REFUSED,
}


OK_PAIRS = [pair for pair, expected in PAIRS.items() if expected == OK]
# Accepted by make_plan but failing when trained: a defect to fix (or to refuse in a check);
# strict, so the entry must go once the pair trains.
KNOWN_BROKEN: dict[tuple[str, str], str] = {}  # none now: quantization+compress is refused


def test_the_table_has_a_row_for_every_technique_and_pair():
    specs = [CPU_SPEC.get(t.name, t.name) for t in list_techniques()]
    missing = [s for s in specs if s not in SINGLES]
    assert not missing, f"add rows for {missing} (python tests/test_registry.py prints them)"
    pairs = {frozenset(p) for p in itertools.combinations(specs, 2)}
    listed = {frozenset(p) for p in PAIRS}
    assert pairs == listed, sorted(map(sorted, pairs ^ listed))


@pytest.mark.parametrize("spec", list(SINGLES))
def test_each_technique_alone(spec):
    check_outcome([spec], SINGLES[spec])
    if SINGLES[spec] == OK:
        trains([spec])


@pytest.mark.parametrize("pair", list(PAIRS), ids=["+".join(p) for p in PAIRS])
def test_each_pair_is_accepted_or_refused_as_the_table_says(pair):
    check_outcome(list(pair), PAIRS[pair])
    check_outcome(list(reversed(pair)), PAIRS[pair])  # the user's order changes nothing


@pytest.mark.slow
@pytest.mark.parametrize("pair", [
    pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BROKEN[p]))
    if p in KNOWN_BROKEN else p for p in OK_PAIRS], ids=["+".join(p) for p in OK_PAIRS])
def test_each_accepted_pair_trains(pair):
    trains(list(pair))


# -- the table by network ---------------------------------------------------------------------
# Every technique works with every ResNet-family encoder: each one alone is planned exactly as
# the table says for the study's ResNet-34 U-Net (exceptions would be listed here: none).
ENCODER_EXCEPTIONS: dict[tuple[str, str], str] = {}
ENCODER_SINGLES = [(encoder, spec) for encoder in ENCODERS for spec in SINGLES]
# A user's own network (tests/user_networks/tiny.py): the techniques that act on the U-Net's
# structure refuse it, naming what they act on; the rest plan as for the U-Net.
FACTORY = ModelConfig(factory="user_networks.tiny:net")
NOT_UNET = "which a model.factory network does not have; drop {}, or train a model.encoder U-Net"
FACTORY_SINGLES = {
    **SINGLES,
    'invertible': "invertible converts the encoder's shape-preserving residual blocks, "
                  + NOT_UNET.format("invertible"),
    'quantization': "quantization leaves the U-Net's segmentation head in float32, "
                    + NOT_UNET.format("quantization"),
    'mp': "mp splits the U-Net into its encoder and its decoder + head, " + NOT_UNET.format("mp"),
    'pipeline': "pipeline splits the U-Net into its encoder and its decoder + head, "
                + NOT_UNET.format("pipeline"),
    'checkpoint': "checkpoint (placement=block) checkpoints the U-Net's residual and decoder "
                  "blocks (checkpoint:modules checkpoints any network's top-level or named "
                  "modules), " + NOT_UNET.format("checkpoint"),
    'tile': "tile tiles the U-Net's stem, residual blocks and decoder blocks, "
            + NOT_UNET.format("tile"),
}
FACTORY_TRAINS = [spec for spec, outcome in FACTORY_SINGLES.items() if outcome == OK] + [
    "checkpoint:modules", "checkpoint:modules:modules=down+up"]


@pytest.mark.parametrize("encoder, spec", ENCODER_SINGLES,
                         ids=[f"{e}-{s}" for e, s in ENCODER_SINGLES])
def test_each_technique_plans_with_every_encoder_as_the_table_says(encoder, spec):
    expected = ENCODER_EXCEPTIONS.get((encoder, spec), SINGLES[spec])
    check_outcome([spec], expected, ModelConfig(encoder=encoder))


@pytest.mark.slow
@pytest.mark.parametrize("spec", [s for s, outcome in SINGLES.items() if outcome == OK])
def test_each_accepted_technique_trains_a_bottleneck_encoder(spec):
    """ResNet-50: Bottlenecks with a projection shortcut, 2048 deepest channels."""
    trains([spec], ModelConfig(encoder="resnet50"))


@pytest.mark.parametrize("spec", list(FACTORY_SINGLES))
def test_each_technique_plans_a_users_network_as_the_table_says(spec):
    expected = FACTORY_SINGLES[spec]
    if expected != OK and "model.factory" in expected:  # the whole line, exactly
        with pytest.raises(ConfigError) as err:
            make_plan(tiny_config([spec], FACTORY))
        assert str(err.value) == expected
    else:
        check_outcome([spec], expected, FACTORY)


@pytest.mark.slow
@pytest.mark.parametrize("spec", FACTORY_TRAINS)
def test_the_generic_techniques_train_a_users_network(spec):
    trains([spec], FACTORY)


def test_applied_order_and_hash_do_not_depend_on_the_users_order():
    techniques = ["tri_accel:low=bf16:elastic=off", "checkpoint", "quantization", "invertible",
                  "accumulate"]
    orders, hashes, applied = set(), set(), set()
    for perm in itertools.permutations(techniques):  # all 120 orders
        cfg = tiny_config(list(perm))
        plan = make_plan(cfg)
        orders.add(tuple(plan.chosen))
        applied.add(tuple(plan.applied()))
        hashes.add(config_hash(cfg))
    assert len(orders) == len(hashes) == len(applied) == 1, (orders, hashes)
    order = list(orders.pop())
    keys = [composition_key(get_technique(n)) for n in order]
    assert keys == sorted(keys)  # stage, declared order, name
    assert order.index("invertible") < order.index("quantization")  # both STRUCTURE
    assert order.index("tri_accel") < order.index("accumulate")  # both RUNTIME
    assert canonical(techniques) == list(applied.pop())


def test_the_stored_config_records_the_applied_order():
    cfg = tiny_config(["quantization", "checkpoint", "invertible"])
    rec = execute(cfg, db=None)
    assert rec.status == "ok", rec.error
    assert [t.split(":")[0] for t in rec.config["techniques"]] == [
        "invertible", "quantization", "checkpoint"]


def test_facts_are_declared_not_named():
    """The plan answers from declarations: who owns the process group, who splits the batch,
    how many GPUs a run holds (planned as on a 2-GPU host)."""
    import torch

    def plan(techniques, world_size):
        cfg = tiny_config(techniques)
        cfg.world_size, cfg.train.device, cfg.train.warmup_steps = world_size, "cuda", 2
        cfg.train.batch_size = 2
        return make_plan(cfg, device=torch.device("cuda"), n_gpus=2)

    dp = plan(["dp"], 2)
    assert dp.group_owners() == ["dp"] and dp.shards_batch() and dp.gpus_needed() == 2
    local = plan(["mp:mode=local"], 1)
    assert local.group_owners() == [] and not local.shards_batch() and local.gpus_needed() == 2
    process = plan(["mp"], 2)
    assert process.group_owners() == ["mp"] and process.gpus_needed() == 2
    assert make_plan(tiny_config(["checkpoint"])).gpus_needed() == 0  # the CPU holds no GPU
    assert plan([], 1).gpus_needed() == 1  # no technique: one process, one GPU
    for techniques in (["mp", "dp"], ["dp", "mp"]):  # two owners of the process group
        with pytest.raises(ConfigError) as err:
            plan(techniques, 2)
        assert str(err.value) == ("mp and dp each need the whole process group; combining them "
                                  "(2-D parallelism) is not supported: drop one of them")
    with pytest.raises(ConfigError) as err:  # fsdp's own check comes first
        plan(["dp", "fsdp"], 2)
    assert str(err.value) == "fsdp is itself data parallel (it shards what dp replicates): drop dp"
    with pytest.raises(ConfigError) as err:
        plan(["checkpoint"], 2)
    assert str(err.value) == (
        "world_size 2 starts several processes but no distributed technique uses them; add one "
        "that owns the process group (mp, pipeline, daso, dp, fsdp) to techniques, or set "
        "world_size = 1")


def test_every_stage_has_a_technique_and_unknown_names_list_the_valid_ones():
    assert {t.stage for t in list_techniques()} == set(Stage)
    with pytest.raises(ConfigError) as err:
        get_technique("nope")
    valid = sorted(t.name for t in list_techniques())
    assert str(err.value) == f"unknown technique 'nope'; valid: {valid} (see `memstudy techniques`)"
    with pytest.raises(ConfigError) as err:
        make_plan(tiny_config(["checkpoint", "checkpoint:sqrt"]))
    assert str(err.value) == ("technique 'checkpoint' given twice in techniques ['checkpoint', "
                              "'checkpoint:sqrt']; keep one")


def test_every_technique_has_a_page_and_every_page_a_technique():
    names = {t.name for t in list_techniques()}
    pages = {p.stem for p in DOCS.glob("*.md")}
    assert names - pages == set(), f"write docs/techniques/<name>.md for {sorted(names - pages)}"
    assert pages - names == set(), f"pages without a technique: {sorted(pages - names)}"
    for name in names:  # a page about this technique, with more than a title
        text = (DOCS / f"{name}.md").read_text()
        assert f"`{name}" in text and len(text) > 800, f"docs/techniques/{name}.md is too thin"


def _print_table() -> None:
    """The current outcomes, in this file's format (for adding a technique's rows)."""
    print("SINGLES = {")
    for spec in SPECS:
        print(f"    {spec!r}: {_literal(plan_outcome([spec]))},")
    print("}\nPAIRS = {")
    for a, b in itertools.combinations(SPECS, 2):
        print(f"    ({a!r}, {b!r}): {_literal(plan_outcome([a, b]))},")
    print("}")


def _literal(outcome: str) -> str:
    known = {v: k for k, v in globals().items() if k.endswith("_REFUSED")}
    return "OK" if outcome == OK else known.get(outcome, repr(outcome))

