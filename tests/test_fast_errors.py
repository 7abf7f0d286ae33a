"""A mistyped setting, size, technique or file is answered before torch loads.

Importing torch and the technique modules takes seconds (more on a busy machine); the CLI
checks what it can without them first (techniques.check_early: the config, then the technique
list with its options, declared torch-free in memstudy/techniques/options.py). Each case runs
`memstudy run` in a fresh interpreter and checks the one-line error, the exit status and that
neither torch nor a technique module was imported."""
from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from memstudy.cli import main
rc = main(["run", *sys.argv[1:]])
registry = ("memstudy.techniques.base", "memstudy.techniques._registry",
            "memstudy.techniques.options")
heavy = sorted(m for m in sys.modules if m == "torch"
               or m.startswith("memstudy.techniques.") and m not in registry)
print("RC", rc, "HEAVY", heavy)
"""


@pytest.mark.parametrize("args, message", [
    (["--size", "abc"], "train.image_size = 'abc' is not a size"),
    (["-t", "amp,chekpoint"], "unknown technique 'chekpoint'"),
    (["--config", "missing.toml"], "config file 'missing.toml' not found"),
    (["--set", "train.lrr=1"], "--set train.lrr: no such setting"),
    (["--data", "no-such-folder"], "data.path 'no-such-folder': data folder not found"),
    (["--budget", "4XB"], "budget '4XB' is not a byte size"),
    (["--epochs", "0"], "train.epochs must be >= 1"),
    (["-t", "amp:fp17"], "technique amp: dtype='fp17' is not one of ['fp16', 'bf16', 'tf32']"),
    (["-t", "checkpoint:placement=nope"], "technique checkpoint: placement='nope' is not one"),
    (["-t", "amp:bf16,tile:levels=9"], "tile:levels=9: the U-Net has 6 resolution levels"),
    (["-t", "tile:rows=-4"], "tile: tiles=0 and rows=-4 must be >= 0"),
    (["-t", "amp:fp16:init_scale=0"], "amp: init_scale must be > 0 (got 0.0)"),
    (["-t", "invertible:gamma=x"], "technique invertible: gamma='x' is not a valid float"),
    (["-t", "offload:nope=1"], "technique offload has no option 'nope'"),
])
def test_a_bad_run_is_refused_before_torch_loads(args, message, tmp_path):
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert f"memstudy: error: {message}" in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # one line, no traceback
    assert "RC 2 HEAVY []" in done.stdout, done.stdout


def test_maxres_refuses_a_bad_technique_option_before_torch_loads(tmp_path):
    probe = PROBE.replace('main(["run", *sys.argv[1:]])', 'main(["maxres", *sys.argv[1:]])')
    done = subprocess.run([sys.executable, "-c", probe, "--budget", "1GiB", "--sets",
                           "amp:bf16", "--sets", "amp:fp17"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert "memstudy: error: technique amp: dtype='fp17'" in done.stderr, done.stderr[-2000:]
    assert "RC 2 HEAVY []" in done.stdout, done.stdout


def test_every_technique_module_registers_its_own_name_and_declared_options():
    """The technique list is parsed from options.py's declarations alone; each technique
    module registers the technique of its file's name with those options (_registry.register
    refuses other options, stage or order)."""
    from memstudy.techniques import declared, list_techniques, technique_names
    from memstudy.techniques.options import DECLARED

    assert technique_names() == sorted(t.name for t in list_techniques()) == sorted(DECLARED)
    for tech in list_techniques():
        assert (tech.stage, tech.order) == (declared(tech.name).stage, declared(tech.name).order)


def test_choices_mirrored_in_options_agree_with_the_plugins():
    from memstudy.distributed.context import BACKENDS
    from memstudy.kernels import IMPLS
    from memstudy.lr_schedule import SCHEDULERS
    from memstudy.techniques import daso, options, pipeline

    assert options.KERNEL_IMPLS == IMPLS and options.GROUP_BACKENDS == BACKENDS
    assert options.LR_SCHEDULERS == SCHEDULERS
    assert options.PIPELINE_SCHEDULES == tuple(pipeline.SCHEDULES)
    assert options.DASO_WIRE == tuple(daso.WIRE)
