"""ab (AB training, [Coquelin] (docs/references.md) Algorithm 2) on 4 gloo processes with DDP: the phase schedule,
independent A / B groups, the eq. 5.8 synchronisation, the recorded communication; refusals."""
from __future__ import annotations

import datetime
import os
import pickle
import socket

import pytest
import torch
import torch.distributed as dist

from conftest import small_config
from memstudy.errors import ConfigError

WORLD, WARMUP, AB_STEPS, REBOUND, TOTAL = 4, 2, 3, 2, 10


def make_plan(config):
    """compose's make_plan, imported on first use: the spawned ranks import this module and
    need only torch (compose brings the model libraries: ~2 s more in each of the 4 ranks)."""
    from memstudy.techniques.compose import make_plan as plan

    return plan(config)


def _model():
    torch.manual_seed(0)
    n = torch.nn
    return n.Sequential(n.Conv2d(1, 4, 3), n.ReLU(), n.Conv2d(4, 6, 3), n.ReLU(), n.Conv2d(6, 5, 3),
                        n.Flatten(), n.Linear(5 * 4 * 4, 2)).double()


def _worker(r, port, out_dir):
    from torch.nn.parallel import DistributedDataParallel

    from memstudy.lowrank.ab_training import ABSchedule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    inner = _model()
    ddp = DistributedDataParallel(inner)
    sched = ABSchedule(inner, ddp, WARMUP, AB_STEPS, REBOUND, cutoff=0.3, skip_first=True,
                       skip_last=True, rank=r, world=WORLD)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    opt.register_step_pre_hook(lambda o, a, k: sched.before_step(o))
    gen = torch.Generator().manual_seed(10 + r)
    log = {"grads": {}, "factors": {}, "weights": {}, "trained": {}}
    for t in range(1, TOTAL + 1):
        opt.zero_grad()
        x = torch.randn(2, 1, 10, 10, generator=gen, dtype=torch.float64)
        with sched.forward_context():
            loss = ddp(x).square().mean()
        loss.backward()
        opt.step()
        log["grads"][t] = {n: p.grad.clone() for n, p in inner.named_parameters() if p.grad is not None}
        log["factors"][t] = {f.name: (f.module.ab_a.detach().clone(), f.module.ab_b.detach().clone())
                             for f in sched.factors}
        log["trained"][t] = [n for n, p in inner.named_parameters() if p.requires_grad]
        sched.after_step(t, opt)
        log["weights"][t] = {n: p.detach().clone() for n, p in inner.named_parameters()}
    log["rows"] = sched.series()
    with open(os.path.join(out_dir, f"rank{r}.pkl"), "wb") as fh:
        pickle.dump(log, fh)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ab")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(port, str(out)), nprocs=WORLD, join=True)
    result = []
    for r in range(WORLD):
        with open(out / f"rank{r}.pkl", "rb") as fh:
            result.append(pickle.load(fh))
    return result


def _events(log, name):
    return {s: v for _, s, n, v in log["rows"] if n == name}


def test_schedule_decomposes_after_warmup_and_each_rebound_and_syncs_after_ab_steps(logs):
    for log in logs:
        assert sorted(_events(log, "ab_rank_sum")) == [2, 7]
        assert sorted(_events(log, "ab_sync")) == [5, 10]
        for t in (3, 4, 5, 8, 9, 10):
            assert set(log["factors"][t]) == {"2", "4"}  # stem conv and head kept full rank
        for t in (1, 2, 6, 7):
            assert log["factors"][t] == {}


def test_a_group_trains_a_and_b_group_trains_b(logs):
    for r, log in enumerate(logs):
        trained = log["trained"][4]
        want, frozen = ("ab_a", "ab_b") if r < WORLD // 2 else ("ab_b", "ab_a")
        assert "2." + want in trained and "2." + frozen not in trained


def test_groups_average_gradients_inside_the_group_only_during_ab(logs):
    g = lambda r, t: logs[r]["grads"][t]  # noqa: E731
    for t in (3, 4):
        for a, b in ((0, 1), (2, 3)):
            assert all(torch.allclose(g(a, t)[n], g(b, t)[n], atol=1e-12) for n in g(a, t))
        shared = "0.weight"  # a full-rank parameter both groups train
        assert not torch.allclose(g(0, t)[shared], g(2, t)[shared])
    for t in (1, 6):  # DP: DDP averages over all ranks
        assert all(torch.allclose(g(0, t)[n], g(3, t)[n], atol=1e-12) for n in g(0, t))


def test_sync_sets_w_to_mean_a_times_mean_b_on_every_rank(logs):
    for name in ("2", "4"):
        mean_a = sum(log["factors"][5][name][0] for log in logs) / WORLD
        mean_b = sum(log["factors"][5][name][1] for log in logs) / WORLD
        w = logs[0]["weights"][5][name + ".weight"]
        assert torch.allclose(w, (mean_a @ mean_b).reshape(w.shape), atol=1e-12)
        for log in logs:
            assert torch.equal(log["weights"][5][name + ".weight"], w)
    # the other parameters are averaged too: all replicas equal after the sync
    for n, v in logs[0]["weights"][5].items():
        assert all(torch.allclose(log["weights"][5][n], v, atol=1e-12) for log in logs)


def test_ab_steps_communicate_less_than_dp_steps(logs):
    comm = {s: v for _, s, n, v in logs[0]["rows"] if n == "ab_comm_bytes"}
    assert len(comm) == TOTAL
    assert comm[3] < comm[1] and comm[4] < comm[6]
    assert comm[5] > comm[4]  # the synchronisation sends A, B and the rest once


def _cfg(techniques, world=2, images=8):
    cfg = small_config(techniques=techniques, batch_size=2, warmup_steps=2)
    cfg.world_size, cfg.data.train_images = world, images
    return cfg


@pytest.mark.parametrize("techniques, match", [
    (["ab"], "add dp"), (["dp", "ab:sigma_cutoff=1.5"], "ab:sigma_cutoff"),
    (["dp", "ab:ab_steps=0"], "ab:ab_steps"), (["dp", "ab:warmup=3:ab_steps=2"], "ab:warmup=3")])
def test_bad_options_are_refused_by_name(techniques, match):
    with pytest.raises(ConfigError, match=match):
        make_plan(_cfg(techniques))


def test_valid_config_plans():
    make_plan(_cfg(["dp", "ab:warmup=1:ab_steps=2:rebound=1"]))
