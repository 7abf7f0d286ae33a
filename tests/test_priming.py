"""benchmarks/priming.py: every configuration run once, unrecorded, before a benchmark's
recorded runs (run-level figures of the first run would otherwise hold cuDNN autotuning)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import priming  # noqa: E402

from memstudy.config import RunConfig  # noqa: E402
from memstudy.errors import ConfigError  # noqa: E402


class Rec:
    status = "ok"


def test_prime_runs_each_config_once_unrecorded_on_a_copy(monkeypatch):
    calls = []
    monkeypatch.setattr(priming, "execute", lambda cfg, db: calls.append((cfg, db)) or Rec())
    configs = [RunConfig(techniques=["amp:bf16"]), RunConfig(techniques=[])]
    said = []
    priming.prime(configs, say=said.append)
    assert [c.techniques for c, _ in calls] == [["amp:bf16"], []]
    assert all(db is None for _, db in calls)  # nothing recorded
    assert all(c is not orig for (c, _), orig in zip(calls, configs))  # the caller's stay untouched
    assert len(said) == 2 and "ok" in said[0]


def test_prime_disabled_runs_nothing(monkeypatch):
    monkeypatch.setattr(priming, "execute", lambda cfg, db: pytest.fail("primed"))
    priming.prime([RunConfig()], enabled=False)


def test_prime_stops_on_a_refused_config_with_its_message(monkeypatch):
    def refuse(cfg, db):
        raise ConfigError("raise train.epochs")
    monkeypatch.setattr(priming, "execute", refuse)
    with pytest.raises(SystemExit, match=r"\['amp:bf16'\]: raise train.epochs"):
        priming.prime([RunConfig(techniques=["amp:bf16"])])


def test_primed_note_says_which_order_the_figures_hold():
    assert "unrecorded" in priming.primed_note(True)
    assert "--no-prime" in priming.primed_note(False)
