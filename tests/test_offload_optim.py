"""offload_optim: the optimizer state in host memory between steps, stepped bucket by bucket.

On the CPU the wrapper's mechanics run with host = compute = cpu (`HostStateOptimizer`
directly): parameters bitwise equal to the plain optimizer's, state_dict both ways, and the
refusals through make_plan. On a GPU: no optimizer state on the device after a step, the
same parameters as the plain optimizer, and no host sync in the step."""
from __future__ import annotations

import pytest
import torch

from memstudy.config import RunConfig
from memstudy.errors import ConfigError, MemstudyError
from memstudy.techniques.compose import make_plan
from memstudy.techniques.offload_optim import HostStateOptimizer, make_buckets

CPU = torch.device("cpu")
SHAPES = [(3, 4), (7,), (2, 3, 5, 5), (1,), (10, 10), (4, 3, 3, 3)]
OPTIMIZERS = {
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.05),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam-amsgrad": lambda groups: torch.optim.Adam(groups, lr=0.05, amsgrad=True),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=0.01, momentum=0.5),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05),
}


def make_params(dtype: torch.dtype, device=CPU) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype).to(device))
              for s in SHAPES]
    params[-1].data = params[-1].data.to(memory_format=torch.channels_last)  # NHWC, as convs
    return params


def two_groups(params):
    """Two parameter groups with different learning rates (one the optimizer's default)."""
    return [{"params": params[:2], "lr": 0.1}, {"params": params[2:]}]


def set_grads(step: int, *param_lists) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for same in zip(*param_lists):
        grad = torch.randn(same[0].shape, generator=g, dtype=same[0].dtype)
        for p in same:
            p.grad = grad.to(p.device).to(memory_format=torch.preserve_format).clone()
            if p.dim() == 4:
                p.grad = p.grad.contiguous(memory_format=torch.channels_last)


def train_both(name: str, dtype: torch.dtype, limit: int, steps: int = 4, device=CPU):
    plain_params, host_params = make_params(dtype, device), make_params(dtype, device)
    plain = OPTIMIZERS[name](two_groups(plain_params))
    wrapped = HostStateOptimizer(OPTIMIZERS[name](two_groups(host_params)), device, limit)
    for step in range(steps):
        set_grads(step, plain_params, host_params)
        plain.step()
        wrapped.step()
    return plain_params, host_params, plain, wrapped


# bucket limits (bytes): one parameter each, ones that split the groups, all in one
LIMITS = [1, 300, 1000, 1 << 30]


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_parameters_bitwise_equal_to_the_plain_optimizer(name, dtype, limit):
    plain, offloaded, _, wrapped = train_both(name, dtype, limit)
    for a, b in zip(plain, offloaded):
        assert torch.equal(a, b), (name, dtype, limit)
        assert a.stride() == b.stride()
    buckets = len(wrapped.buckets())
    assert buckets == {1: len(SHAPES), 1 << 30: 1}.get(limit, buckets) and \
        (1 < buckets < len(SHAPES) or limit in (1, 1 << 30))


@pytest.mark.parametrize("limit", [1, 2000])
def test_state_is_in_host_buffers_between_steps_and_equals_the_plain_state(limit):
    _, _, plain, wrapped = train_both("adam", torch.float32, limit)
    assert wrapped.state is wrapped.inner.state and wrapped.param_groups is wrapped.inner.param_groups
    hosts = {id(layout.host) for layout in wrapped.layouts.values()}
    for p_plain, p_host in zip(plain.param_groups[1]["params"], wrapped.param_groups[1]["params"]):
        for key, value in plain.state[p_plain].items():
            held = wrapped.state[p_host][key]
            assert torch.equal(value, held) and held.stride() == value.stride()
            assert held.untyped_storage().data_ptr() in {
                wrapped.layouts[i].host.untyped_storage().data_ptr() for i in wrapped.layouts}
    assert len(hosts) == len(wrapped.buckets())
    assert wrapped.host_bytes() >= sum(2 * p.nbytes for g in wrapped.param_groups for p in g["params"])


def test_buckets_hold_at_least_one_parameter_and_respect_the_limit():
    params = make_params(torch.float32)
    groups = two_groups(params)
    for limit in LIMITS:
        buckets = make_buckets(groups, limit)
        flat = [p for bucket in buckets for _, ps in bucket for p in ps]
        assert [id(p) for p in flat] == [id(p) for p in params]  # every one, once, in order
        for bucket in buckets:
            sizes = [p.nbytes for _, ps in bucket for p in ps]
            assert len(sizes) == 1 or sum(sizes) <= limit


def test_state_dict_round_trips_both_ways():
    """A checkpoint of the wrapped optimizer loads into a plain one and vice versa; training
    on from either gives the plain optimizer's parameters bit for bit."""
    plain_params, host_params, plain, wrapped = train_both("adam", torch.float32, 300, steps=2)
    saved_plain = _clone(plain.state_dict())
    saved_wrapped = _clone(wrapped.state_dict())
    fresh_plain = torch.optim.Adam(two_groups(host_params), lr=0.05)
    fresh_plain.load_state_dict(saved_wrapped)
    fresh_wrapped = HostStateOptimizer(torch.optim.Adam(two_groups(plain_params), lr=0.05), CPU, 300)
    fresh_wrapped.load_state_dict(saved_plain)
    assert fresh_wrapped.layouts and fresh_wrapped.state is fresh_wrapped.inner.state
    copies_a, copies_b = [p.detach().clone() for p in plain_params], [p.detach().clone() for p in host_params]
    reference = torch.optim.Adam(two_groups(copies_a), lr=0.05)
    reference.load_state_dict(_clone(saved_plain))
    for step in range(2, 4):
        set_grads(step, plain_params, host_params, copies_a)
        fresh_wrapped.step()  # on plain_params, from the plain checkpoint
        fresh_plain.step()  # on host_params, from the wrapped checkpoint
        reference.step()
    for a, b, c in zip(plain_params, host_params, copies_a):
        assert torch.equal(a, c) and torch.equal(b, c)


def _clone(state_dict):
    import copy
    return copy.deepcopy(state_dict)


def test_zero_grad_passes_through_and_the_lr_of_a_group_is_read_at_each_step():
    params = make_params(torch.float32)
    wrapped = HostStateOptimizer(torch.optim.SGD(two_groups(params), lr=0.05), CPU, 300)
    set_grads(0, params)
    wrapped.zero_grad()
    assert all(p.grad is None for p in params)
    set_grads(0, params)
    wrapped.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)
    for group in wrapped.param_groups:  # as the LR policy sets it: on the shared group dicts
        group["lr"] = 0.0
    before = [p.detach().clone() for p in params]
    set_grads(1, params)
    wrapped.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params))


def test_non_elementwise_optimizers_and_hooked_ones_are_refused():
    params = make_params(torch.float32)
    with pytest.raises(ConfigError, match="LBFGS is not one: drop offload_optim"):
        HostStateOptimizer(torch.optim.LBFGS(params), CPU, 300)
    hooked = torch.optim.Adam(params)
    hooked.register_step_pre_hook(lambda *args: None)
    with pytest.raises(ConfigError, match="has step hooks, which would run once per bucket"):
        HostStateOptimizer(hooked, CPU, 300)


def test_hooks_on_the_wrapper_run_once_per_step():
    params = make_params(torch.float32)
    wrapped = HostStateOptimizer(torch.optim.Adam(two_groups(params)), CPU, 1)
    runs = []
    wrapped.register_step_pre_hook(lambda *args: runs.append(1))
    set_grads(0, params)
    wrapped.step()
    assert runs == [1] and len(wrapped.buckets()) == len(SHAPES)


def test_changed_parameter_groups_after_the_state_moved_are_refused():
    params = make_params(torch.float32)
    wrapped = HostStateOptimizer(torch.optim.Adam([{"params": params[:3]}]), CPU, 300)
    set_grads(0, params[:3])
    wrapped.step()
    wrapped.add_param_group({"params": params[3:]})
    with pytest.raises(MemstudyError, match="parameter groups changed"):
        wrapped.step()


def test_a_parameter_whose_state_appears_later_is_laid_out_again():
    """A parameter without a gradient has no state; at its first gradient the bucket's state
    is laid out again, and the result still equals the plain optimizer's."""
    a, b = make_params(torch.float32), make_params(torch.float32)
    plain = torch.optim.Adam(two_groups(a), lr=0.05)
    wrapped = HostStateOptimizer(torch.optim.Adam(two_groups(b), lr=0.05), CPU, 1 << 30)
    for step in range(3):
        set_grads(step, a, b)
        if step == 0:
            a[2].grad = b[2].grad = None
        plain.step()
        wrapped.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# -- refusals through the config path -----------------------------------------------------------
def plan(techniques: list[str], device: str = "cuda", world_size: int = 1, n_gpus: int = 1,
         size: int = 64):
    cfg = RunConfig(techniques=techniques)
    cfg.train.image_size, cfg.train.msssim_scales, cfg.train.device = size, 1, device
    cfg.train.warmup_steps, cfg.train.batch_size, cfg.world_size = 2, 2, world_size
    cfg.data.train_images = 8
    return make_plan(cfg, device=torch.device(device), n_gpus=n_gpus)


def test_refused_on_the_cpu_naming_train_device():
    with pytest.raises(ConfigError, match="train.device resolves to cpu.*use train.device=cuda "
                                          "or drop offload_optim"):
        plan(["offload_optim"], device="cpu", n_gpus=0)


@pytest.mark.parametrize("bucket, message", [
    ("0", "must be a positive byte size"), ("0MB", "must be a positive byte size"),
    ("abc", "offload_optim:bucket 'abc' is not a byte size"),
    ("-5MB", "offload_optim:bucket '-5MB' is not a byte size"),
    ("12QB", "is not a byte size")])
def test_bad_bucket_sizes_are_refused_naming_the_option(bucket, message):
    with pytest.raises(ConfigError, match=message):
        plan([f"offload_optim:bucket={bucket}"])


def test_bucket_sizes_parse_as_memstudy_sizes():
    assert plan(["offload_optim:bucket=64MB"]).chosen["offload_optim"].bucket == "64MB"
    plan(["offload_optim:1e6"])
    plan(["offload_optim:bucket=512KiB"])


@pytest.mark.parametrize("techniques, world_size, n_gpus, message", [
    (["dp", "zero"], 2, 2, "offload_optim with zero: zero shards the optimizer state"),
    (["fsdp"], 2, 2, "offload_optim with fsdp: fsdp shards the optimizer state"),
    (["tri_accel:low=bf16:elastic=off"], 1, 1, "offload_optim with tri_accel: tri_accel rebuilds"),
    (["dp", "ab"], 2, 2, "offload_optim with ab: ab swaps the parameter groups"),
    (["lowrank"], 1, 1, "lowrank replaces weights by trainable factors"),
    (["mp:mode=local"], 1, 2, "offload_optim moves the state of one compute device, but mp"),
    (["compile"], 1, 1, "compile with offload_optim is not supported"),
])
def test_techniques_that_own_the_state_or_the_parameters_are_refused(techniques, world_size,
                                                                      n_gpus, message):
    with pytest.raises(ConfigError, match=message):
        plan(["offload_optim", *techniques], world_size=world_size, n_gpus=n_gpus)


def test_composes_with_the_activation_techniques_and_dp():
    plan(["offload_optim", "amp:bf16", "checkpoint", "offload:which=boundaries:prefetch=1",
          "tile:16:levels=3:keep=conv1:layer1=convs", "allocator:expandable_segments=true"],
         size=4188)
    chosen = plan(["offload_optim", "dp"], world_size=2, n_gpus=2).chosen
    assert list(chosen).index("offload_optim") < list(chosen).index("dp")


# -- on a GPU -------------------------------------------------------------------------------------
def _gpu_model():
    from memstudy.models import build_unet
    return build_unet(seed=0).cuda().to(memory_format=torch.channels_last)


def _gpu_step(model, optimizer, x) -> None:
    loss = model(x).float().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.gpu
def test_gpu_no_state_on_the_device_after_a_step_and_parameters_equal_the_plain_ones():
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    x = torch.rand(1, 1, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    plain_model, host_model = _gpu_model(), _gpu_model()
    params = [p for p in host_model.parameters() if p.requires_grad]
    state_bytes = 2 * sum(p.nbytes for p in params)
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-3)
    wrapped = HostStateOptimizer(torch.optim.Adam(params, lr=1e-3), torch.device("cuda"),
                                 16 * 1024 * 1024)
    _gpu_step(plain_model, plain, x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    _gpu_step(host_model, wrapped, x)
    torch.cuda.synchronize()
    # the plain optimizer's first step left its state on the device; this one left none
    assert torch.cuda.memory_allocated() - before < state_bytes // 100
    on_device = [t for s in wrapped.state.values() for t in s.values() if t.is_cuda]
    assert not on_device and wrapped.host_bytes() >= state_bytes
    assert all(s["step"].device.type == "cpu" for s in wrapped.state.values())  # stays put
    assert all(s["exp_avg"].is_pinned() for s in wrapped.state.values())
    for _ in range(2):
        _gpu_step(plain_model, plain, x)
        _gpu_step(host_model, wrapped, x)
    for a, b in zip(plain_model.parameters(), host_model.parameters()):
        assert torch.equal(a, b)
    saved = wrapped.state_dict()
    assert torch.equal(saved["state"][0]["exp_avg"].cuda(), plain.state_dict()["state"][0]["exp_avg"])


@pytest.mark.gpu
def test_gpu_step_never_syncs_with_the_host():
    """After the first step (state laid out in pinned buffers), a step of several buckets runs
    with torch.cuda.set_sync_debug_mode("error"): any blocking host-device sync raises."""
    x = torch.rand(1, 1, 128, 128, device="cuda")
    model = _gpu_model()
    params = [p for p in model.parameters() if p.requires_grad]
    wrapped = HostStateOptimizer(torch.optim.AdamW(params, lr=1e-3), torch.device("cuda"),
                                 8 * 1024 * 1024)
    _gpu_step(model, wrapped, x)
    assert len(wrapped.buckets()) > 2
    torch.cuda.synchronize()
    loss = model(x).float().mean()
    loss.backward()
    torch.cuda.set_sync_debug_mode("error")
    try:
        wrapped.step()
        wrapped.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(p).all() for p in params)
