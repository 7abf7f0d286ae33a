"""A mistyped setting, size, technique or file is answered before torch loads.

Importing torch and the technique modules takes seconds (more on a busy machine); the CLI
checks what it can without them first (techniques.check_early). Each case runs `memstudy run`
in a fresh interpreter and checks the one-line error, the exit status and that neither torch
nor a technique module was imported."""
from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from memstudy.cli import main
rc = main(["run", *sys.argv[1:]])
registry = ("memstudy.techniques.base", "memstudy.techniques._registry")
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
])
def test_a_bad_run_is_refused_before_torch_loads(args, message, tmp_path):
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert f"memstudy: error: {message}" in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # one line, no traceback
    assert "RC 2 HEAVY []" in done.stdout, done.stdout


def test_every_technique_module_registers_its_own_name():
    """check_names knows the techniques from their file names alone."""
    from memstudy.techniques import list_techniques, technique_names

    assert technique_names() == sorted(t.name for t in list_techniques())
