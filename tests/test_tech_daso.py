"""daso on 4 gloo processes (2 emulated nodes x 2 ranks): the synchronisation schedule, the
node-local gradient average, the eq. 3.2 merge of stale global parameters, and refusals."""
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

WORLD, NODE = 4, 2
B, S, WARMUP, COOLDOWN, TOTAL = 2, 1, 1, 2, 9
LR = 0.1
WIRES = ("fp32", "bf16")  # parameters sent at full precision, then rounded to bf16


def make_plan(config):
    """compose's make_plan, imported on first use: the spawned ranks import this module and
    need only torch (compose brings the model libraries: ~2 s more in each of the 4 ranks)."""
    from memstudy.techniques.compose import make_plan as plan

    return plan(config)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _worker(r, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    for wire in WIRES:  # one process start for both runs (start-up dominates on CI)
        _train(r, out_dir, wire)
    dist.destroy_process_group()


def _train(r, out_dir, wire):
    """One run of TOTAL steps on this rank, from the same initial model and data for every
    wire; its log written to rank{r}-{wire}.pkl."""
    from memstudy.techniques.daso import DASOSync, Options

    torch.manual_seed(0)  # same initial model everywhere
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).double()
    opts = Options(node_size=NODE, B=B, S=S, warmup=WARMUP, cooldown=COOLDOWN, wire=wire)
    sync = DASOSync(model.parameters(), opts, TOTAL, r, WORLD)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.register_step_pre_hook(lambda o, a, k: sync.before_step(o))
    gen = torch.Generator().manual_seed(100 + r)  # every rank its own data
    log = {"grads_local": {}, "grads_avg": {}, "after_step": {}, "after_sync": {}}
    for t in range(1, TOTAL + 1):
        opt.zero_grad()
        x = torch.randn(4, 6, generator=gen, dtype=torch.float64)
        model(x).square().mean().backward()
        log["grads_local"][t] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        opt.step()
        log["grads_avg"][t] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        log["after_step"][t] = _flat(model)
        sync.after_step(t)
        log["after_sync"][t] = _flat(model)
    log["rows"] = sync.series()
    with open(os.path.join(out_dir, f"rank{r}-{wire}.pkl"), "wb") as fh:
        pickle.dump(log, fh)


@pytest.fixture(scope="module")
def wire_logs(tmp_path_factory):
    """{wire: every rank's log}, from one spawn of WORLD processes."""
    out = tmp_path_factory.mktemp("daso")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(port, str(out)), nprocs=WORLD, join=True)
    found = {}
    for wire in WIRES:
        found[wire] = []
        for r in range(WORLD):
            with open(out / f"rank{r}-{wire}.pkl", "rb") as fh:
                found[wire].append(pickle.load(fh))
    return found


@pytest.fixture(scope="module")
def logs(wire_logs):
    return wire_logs["fp32"]


def _events(log, name):
    return {step: value for _, step, n, value in log["rows"] if n == name}


def test_schedule_sends_every_b_cycling_steps_receives_s_later_and_rotates_groups(logs):
    # warm-up: step 1; cycling: steps 2..7; cool-down: 8, 9. Sends at (t - warmup) % B == 0
    for log in logs:
        assert _events(log, "daso_send") == {3: 0.0, 5: 1.0, 7: 0.0}  # group j = 0, 1, 0
        assert _events(log, "daso_receive") == {4: 1.0, 6: 1.0, 7: 0.0}  # last one at cycling's end
        assert _events(log, "daso_blocking") == {7: 1.0}


def test_warmup_and_cooldown_average_gradients_over_all_ranks(logs):
    for t in (1, 8, 9):
        mean = sum(log["grads_local"][t] for log in logs) / WORLD
        for log in logs:
            assert torch.allclose(log["grads_avg"][t], mean, atol=1e-12)
            assert torch.allclose(log["after_sync"][t], logs[0]["after_sync"][t], atol=1e-12)


def test_cycling_averages_gradients_inside_each_node_only(logs):
    for t in range(2, 8):
        for node in range(WORLD // NODE):
            members = logs[node * NODE:(node + 1) * NODE]
            mean = sum(log["grads_local"][t] for log in members) / NODE
            for log in members:
                assert torch.allclose(log["grads_avg"][t], mean, atol=1e-12)
    # the nodes drift apart between synchronisations
    assert not torch.allclose(logs[0]["after_step"][3], logs[2]["after_step"][3])


def test_merge_follows_eq_3_2_and_is_broadcast_inside_the_node(logs):
    # send after step 3 by group 0 (ranks 0 and 2), merged after step 4 (S = 1)
    sent = logs[0]["after_sync"][3] + logs[2]["after_sync"][3]  # sum over the P = 2 nodes
    for node in (0, 1):
        active = logs[node * NODE]
        local = active["after_step"][4]
        expected = (2 * S * local + sent) / (2 * S + WORLD // NODE)
        for log in logs[node * NODE:(node + 1) * NODE]:
            assert torch.allclose(log["after_sync"][4], expected, atol=1e-12)


def test_communication_is_recorded_per_step(logs):
    n_params = logs[0]["after_step"][1].numel()
    rows = {(s, n): v for _, s, n, v in logs[1]["rows"]}  # rank 1: not in group 0
    assert all(rows[(t, "daso_grad_bytes")] == n_params * 8 for t in range(1, TOTAL + 1))
    assert rows[(3, "daso_param_bytes")] == 0  # rank 1 sends nothing for group 0
    assert rows[(5, "daso_param_bytes")] == n_params * 4  # its own send (group 1), fp32 wire
    assert rows[(4, "daso_param_bytes")] == n_params * 8  # received the node broadcast


def test_bf16_wire_rounds_the_sent_parameters(wire_logs):
    logs = wire_logs["bf16"]
    sent = (logs[0]["after_sync"][3].to(torch.bfloat16) + logs[2]["after_sync"][3].to(torch.bfloat16))
    local = logs[0]["after_step"][4]
    expected = (2 * S * local + sent.double()) / (2 * S + 2)
    assert torch.allclose(logs[0]["after_sync"][4], expected, atol=1e-2)
    assert not torch.allclose(logs[0]["after_sync"][4],
                              (2 * S * local + logs[0]["after_sync"][3] + logs[2]["after_sync"][3]) / 4,
                              atol=1e-7)


def _plan(world=4, images=8, **daso):
    opts = ":".join(f"{k}={v}" for k, v in daso.items())
    cfg = small_config(techniques=[f"daso:{opts}" if opts else "daso"], batch_size=4)
    cfg.world_size, cfg.data.train_images = world, images
    return cfg


@pytest.mark.parametrize("daso, match", [
    ({"node_size": 2, "B": 0}, "daso:B"), ({"node_size": 2, "S": 0}, "daso:S"),
    ({"node_size": 2, "B": 2, "S": 3}, "daso:S=3"), ({"node_size": 4}, "daso:node_size"),
    ({"node_size": 3}, "daso:node_size"), ({"node_size": 2, "warmup": 1, "cooldown": 1}, "daso:warmup")])
def test_bad_options_are_refused_by_name(daso, match):
    with pytest.raises(ConfigError, match=match):
        make_plan(_plan(**daso))


def test_one_rank_is_refused():
    with pytest.raises(ConfigError, match="world_size"):
        make_plan(_plan(world=1, node_size=1))


def test_valid_config_plans():
    make_plan(_plan(images=16, node_size=2, warmup=1, cooldown=1))
