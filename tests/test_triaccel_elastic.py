"""The elastic batch controller: grows under low usage, shrinks under high usage, and survives an
out-of-memory error from its own growth under a capped budget (CPU tensor meter)."""
from __future__ import annotations


from memstudy.runner import execute
from memstudy.store import ResultsDB
from memstudy.techniques.tri_accel.elastic import ElasticBatch


def _ctrl(batch=2, **kw) -> ElasticBatch:
    args = dict(rho_low=0.6, rho_high=0.85, delta_up=2, delta_down=1, max_batch=7)
    args.update(kw)
    return ElasticBatch(batch, **args)


def test_grows_below_rho_low_up_to_max_batch():
    c = _ctrl()
    assert [c.decide(used=50, capacity=100) for _ in range(4)] == [4, 6, 7, 7]


def test_shrinks_above_rho_high_never_below_one():
    c = _ctrl(batch=3)
    assert [c.decide(used=90, capacity=100) for _ in range(4)] == [2, 1, 1, 1]


def test_holds_between_thresholds():
    c = _ctrl(batch=3)
    assert c.decide(used=70, capacity=100) == 3


def test_oom_shrinks_and_caps_later_growth():
    c = _ctrl(batch=5)
    assert c.on_oom() and c.batch == 4 and c.ceiling == 4
    assert c.decide(used=10, capacity=100) == 4  # never grows back into the size that failed
    c.batch = 1
    assert not c.on_oom()  # nothing left to shrink: the run records the OOM


def test_capped_budget_run_grows_hits_oom_shrinks_and_finishes(make_config, tmp_path):
    # 192 px, CPU, Adam, as the tensor meter counts: a peak of ~400 MB at batch 1 (the
    # optimizer step dominates), ~410 MB at 2, ~470 MB at 3, ~500 MB at 4. Under a 440 MiB
    # (461 MB) budget the controller grows 1 -> 4, which fails, then 3, which fails too, and
    # settles at 2: two out-of-memory errors in one step, both absorbed.
    cfg = make_config(techniques=["tri_accel:precision=off:curvature=off:t_ctrl=1:"
                                  "rho_low=0.95:rho_high=0.99:delta_up=3:delta_down=1"])
    cfg.budget = "440MiB"
    cfg.data.train_images = 5
    cfg.train.validate = False
    # The step that grows to 4 is measured (all three tries of it): a failed measured forward
    # must free its tensors, or every retry fails too (tests/test_oom_retry.py).
    cfg.train.warmup_steps = 1
    cfg.train.measure_steps = 1
    db = ResultsDB(tmp_path / "r.sqlite")
    rec = execute(cfg, db)
    assert rec.status == "ok", rec.error
    batches = [v for _, _, name, v in rec.series if name == "batch_size"]
    assert max(batches) >= 2  # grew under low usage
    ooms = [v for _, _, name, v in rec.series if name == "tri/oom_at_batch"]
    assert ooms, f"expected an out-of-memory error from growth; batches {batches}"
    assert ooms == [3.0]  # one row per step: the last failure (4 failed first)
    assert batches == [1, 2, 2]  # 4 and 3 failed and were retried at 2; no regrowth
    metrics = dict(((p, n), v) for _, p, n, v in rec.metrics)
    assert metrics[("run", "oom_retries")] == 2
    assert metrics[("forward", "measured_steps")] == 1  # the try that fitted, at batch 2
    assert sum(batches) == 5  # every image trained once: the failed step was retried
    (run,) = db.runs()
    stored = {r["name"] for r in db.series(run["id"], "tri/%")}
    assert {"tri/mem_used_bytes", "tri/batch_next", "tri/oom_at_batch"} <= stored
