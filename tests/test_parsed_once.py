"""Each value of a run is parsed, checked and resolved once (issue 42).

`memstudy run` parses the technique list and the budget in techniques.check_early, before
torch loads, and hands the result down (make_plan, runner.execute, the plan's facts): the
config keeps what was written (it is stored and hashed), the run uses the parsed values. One
small CPU run through the CLI, in this process, with every parser and resolver counted."""
from __future__ import annotations

import sys
from collections import Counter

from memstudy.byte_sizes import parse_bytes
from memstudy.cli import main
from memstudy.config import RunConfig, TrainConfig
from memstudy.techniques import parse_techniques, resolve_run_settings


def _count_every_binding(monkeypatch, calls: Counter, func, name: str) -> None:
    """Wrap `func` wherever a memstudy module bound it (`from x import func` copies it)."""
    def counted(*args, **kwargs):
        calls[name] += 1
        return func(*args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("memstudy"):
            for attr, value in list(vars(module).items()):
                if value is func:
                    monkeypatch.setattr(module, attr, counted)


def _count_method(monkeypatch, calls: Counter, cls: type, method: str) -> None:
    original = getattr(cls, method)

    def counted(self, *args, **kwargs):
        calls[method] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, counted)


def test_one_cpu_run_parses_checks_and_resolves_each_value_once(tmp_path, monkeypatch, capsys):
    import memstudy.runner  # noqa: F401  (the modules whose bindings are wrapped)
    import memstudy.techniques.compose  # noqa: F401

    calls: Counter = Counter()
    _count_every_binding(monkeypatch, calls, parse_techniques, "parse_techniques")
    _count_every_binding(monkeypatch, calls, parse_bytes, "parse_bytes")  # the budget's parser
    _count_every_binding(monkeypatch, calls, resolve_run_settings, "resolve_run_settings")
    _count_method(monkeypatch, calls, RunConfig, "check")
    _count_method(monkeypatch, calls, TrainConfig, "resolve_tuning")
    code = main(["--db", str(tmp_path / "once.sqlite"), "run", "--size", "64", "--device", "cpu",
                 "-q", "-t", "amp:bf16", "--budget", "4GiB", "--set", "train.msssim_scales=1",
                 "--set", "data.train_images=1", "--set", "data.val_images=1",
                 "--set", "train.warmup_steps=0", "--set", "train.measure_steps=1",
                 "--set", "train.validate=false"])
    assert code == 0, capsys.readouterr()
    assert calls == {"parse_techniques": 1, "parse_bytes": 1, "resolve_run_settings": 1,
                     "check": 1, "resolve_tuning": 1}
    out = capsys.readouterr().out
    assert "amp:bf16 | 64 px" in out and "status ok" in out
