"""compile: a compiled step computes what the eager step computes; every bad option or
unsupported combination is refused by name before anything is built."""
from __future__ import annotations

import functools

import pytest
import torch

from conftest import small_config
from memstudy.config import MeterConfig
from memstudy.errors import ConfigError
from memstudy.meters import PhaseRecorder
from memstudy.runner import execute
from memstudy.techniques.compile import compiled_graphs
from memstudy.techniques.compose import make_plan

# Tolerances. The check compiles the model in float64, where a correct graph matches eager
# up to rounding (measured at 192 px: relative L2 difference of all gradients 9.5e-14). In
# float32 the U-Net's gradient at batch 1 is ill-conditioned (BatchNorm over the small deep
# maps): compiled vs eager differ by ~1.5%, as much as eager float32 differs from eager float64
# (0.9%) or eager NCHW from eager NHWC (1.6%), so float32 cannot tell a wrong graph from a
# reordered sum at a tight tolerance.
GRAD_TOLERANCE = 1e-9
LOSS_TOLERANCE = 1e-5


def cpu_config(techniques: list[str], **train):
    cfg = small_config(techniques=techniques, **train)
    cfg.meter.tensor = "off"  # a dispatch mode would make Dynamo run eagerly (refused)
    return cfg


def _batch(dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    x, y = torch.rand(1, 1, 192, 192, generator=gen), torch.rand(1, 1, 192, 192, generator=gen)
    return x.to(dtype), y.to(dtype)


def _mse_grads(model, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Parameter gradients of a smooth loss (no MS-SSIM clamps) on the fixed batch."""
    x, y = _batch(dtype)
    for p in model.parameters():
        p.grad = None
    ((model(x) - y) ** 2).mean().backward()
    return {n: p.grad.detach().double() for n, p in model.named_parameters()}


def _relative_l2(a: dict, b: dict) -> float:
    num = sum(((a[n] - b[n]) ** 2).sum() for n in b) ** 0.5
    return (num / sum((g ** 2).sum() for g in b.values()) ** 0.5).item()




def _measured_forward(build, dtype=torch.float64):
    """One measured forward + backward of the pipeline (MS-SSIM loss) on the fixed batch."""
    recorder = PhaseRecorder(build.device, build.model, build.runtime, lambda: None,
                             MeterConfig(tensor="off"))
    recorder.in_warmup = False
    x, y = _batch(dtype)
    with recorder.step(measured=True):
        with recorder.phase("forward"):
            loss = build.runtime.forward(build.model, x, y)
        with recorder.phase("backward"):
            build.runtime.backward(loss)
    return loss.item(), recorder.summary()["forward"]


def _user_network(config):
    """tests/user_networks' small network (a user's model.factory): Inductor generates kernels
    for a few layers where the U-Net needs them for every block, and what the compile tests
    check (compiled = eager, the partitioner's choices) does not depend on the network."""
    config.model.factory, config.model.kwargs = "user_networks.tiny:net", {"width": 16}
    return config


@pytest.mark.slow
def test_compiled_step_runs_on_the_cpu_with_eager_gradients():
    """Inductor on the CPU (C++ kernels), in float64: gradients equal the eager model's, a
    measured step sees what the compiled graph saves and recompiles nothing."""
    from memstudy.models import build_model
    from memstudy.techniques.compose import build_pipeline

    config = _user_network(cpu_config(["compile"]))
    build = build_pipeline(make_plan(config))  # resets Dynamo
    build.model.double()  # before the first call: the graphs are traced in float64
    compiled = _mse_grads(build.model, torch.float64)
    assert compiled_graphs() > 0, "the model was not compiled"
    reference = _mse_grads(build_model(config).double(), torch.float64)  # same seed, weights
    assert compiled.keys() == reference.keys()  # compiled in place: same parameter names
    assert _relative_l2(compiled, reference) <= GRAD_TOLERANCE
    # A measured step of the pipeline on the compiled model: the saved-tensor observer sees
    # what the compiled graph saves, and causes no recompilation.
    graphs = compiled_graphs()
    loss, forward = _measured_forward(build)
    assert compiled_graphs() == graphs
    assert forward["saved_bytes"] > 0
    eager = build_pipeline(make_plan(_user_network(cpu_config([]))))
    eager.model.double()
    assert loss == pytest.approx(_measured_forward(eager)[0], rel=LOSS_TOLERANCE)


def test_compile_run_records_its_compile_time():
    """A whole run (aot_eager: no kernel generation, so it stays quick): the first step holds
    the compilation and is recorded apart from the plain step time."""
    cfg = cpu_config(["compile:backend=aot_eager"], measure_steps=1, max_steps=3, validate=False)
    cfg.data.train_images = 3
    rec = execute(cfg, db=None)
    assert rec.status == "ok", rec.error
    run = {name: value for _, phase, name, value in rec.metrics if phase == "run"}
    assert run["first_step_time_s"] > run["step_time_s"]
    assert run["compile_time_s"] == pytest.approx(run["first_step_time_s"] - run["step_time_s"])
    assert rec.config["techniques"] == ["compile:mode=default:memory_budget=1.0:dynamic=False:"
                                        "fullgraph=False:backend=aot_eager"]


@pytest.mark.parametrize("spec, fragment", [
    ("compile:mode=fastest", "mode='fastest' is not one of"),
    ("compile:memory_budget=1.5", "memory_budget=1.5 must be within 0..1"),
    ("compile:memory_budget=-0.1", "memory_budget=-0.1 must be within 0..1"),
    ("compile:memory_budget=half", "memory_budget='half' is not a valid float"),
    ("compile:backend=tvm", "backend='tvm' is not one of"),
    ("compile:dynamic=maybe", "dynamic='maybe' is not a valid bool"),
    ("compile:speed=1", "no option 'speed'"),
    ("compile:backend=aot_eager:mode=max-autotune", "is an Inductor mode"),
    ("compile:backend=aot_eager:memory_budget=0.5", "min-cut partitioner"),
    ("compile:mode=reduce-overhead", "captures CUDA graphs but train.device"),
])
def test_bad_options_are_refused_by_name(spec, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        make_plan(cpu_config([spec]))


@pytest.mark.parametrize("other", ["tri_accel", "invertible", "quantization"])
def test_unsupported_combinations_are_refused_by_name(other):
    with pytest.raises(ConfigError, match=f"compile with {other} is not supported"):
        make_plan(cpu_config(["compile", other]))


def test_boundary_offload_is_refused_with_compile(monkeypatch):
    """The compiled graph's saved tensors bear no boundary mark: nothing would move. Planned
    for a GPU (offload needs one) without one: Triton's check is taken as passed."""
    monkeypatch.setattr("memstudy.techniques.compile.triton_cuda_problem", lambda device: None)
    cfg = cpu_config(["compile", "checkpoint", "offload:which=boundaries"])
    with pytest.raises(ConfigError, match="compile with offload:which=boundaries"):
        make_plan(cfg, device=torch.device("cuda"), n_gpus=1)
    cfg.techniques[-1] = "offload:which=all"
    make_plan(cfg, device=torch.device("cuda"), n_gpus=1)


def test_planning_for_a_gpu_does_not_start_cuda(monkeypatch):
    """Checks run before the allocator technique configures the allocator, which CUDA must
    not have started by then: compile's Triton check and amp:tf32's capability check read
    NVML, not torch's has_triton() / get_device_capability(), which start CUDA (on an H100
    every compile+allocator maxres probe was refused)."""
    import torch.utils._triton as triton_utils

    from memstudy.techniques import amp, compile as compile_technique

    def starts_cuda(*_args):
        raise AssertionError("this reads the GPU's properties: CUDA would start")

    monkeypatch.setattr(triton_utils, "has_triton", starts_cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", starts_cuda)
    monkeypatch.setattr(triton_utils, "has_triton_package", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for module in (amp, compile_technique):
        monkeypatch.setattr(module, "compute_capability", lambda device: (9, 0))
    cuda = torch.device("cuda")
    cfg = cpu_config(["amp:bf16", "compile:memory_budget=0.5", "allocator:expandable_segments=true"])
    make_plan(cfg, device=cuda, n_gpus=1)
    make_plan(cpu_config(["amp:tf32", "allocator:expandable_segments=true"]), device=cuda, n_gpus=1)
    monkeypatch.setattr(compile_technique, "compute_capability", lambda device: (6, 1))
    with pytest.raises(ConfigError, match=r"compute capability 6\.1 is below the 7\.0"):
        make_plan(cfg, device=cuda, n_gpus=1)
    monkeypatch.setattr(triton_utils, "has_triton_package", lambda: False)
    with pytest.raises(ConfigError, match="the triton package is not installed"):
        make_plan(cfg, device=cuda, n_gpus=1)


def test_compute_capability_reads_nvml_without_starting_cuda(monkeypatch):
    """env.compute_capability maps the device through CUDA_VISIBLE_DEVICES to NVML's index
    with an explicit CUDA index: for a bare "cuda" torch would ask current_device(), which
    starts CUDA (what refused the H100 compile+allocator probes after the first fix)."""
    import sys
    from types import SimpleNamespace

    from memstudy.env import compute_capability

    def starts_cuda(*_args):
        raise AssertionError("current_device() starts CUDA")

    asked = []
    fake_nvml = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: asked.append(index) or f"handle {index}",
        nvmlDeviceGetCudaComputeCapability=lambda handle: (9, 0))
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml)
    monkeypatch.setattr(torch.cuda, "current_device", starts_cuda)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert compute_capability(torch.device("cuda")) == (9, 0)
    assert compute_capability(torch.device("cuda", 1)) == (9, 0)
    assert asked == [3, 5]


def test_a_recompilation_after_warm_up_stops_the_run():
    """One warm-up step; the next training forward of the same shape reuses the graph, a
    validation (eval-mode) forward may compile its own, a new shape in training fails by name."""
    from types import SimpleNamespace

    from memstudy.techniques.compose import build_pipeline

    build = build_pipeline(make_plan(cpu_config(["compile:backend=aot_eager"])))
    rt, model = build.runtime, build.model
    x, y = _batch()
    rt.forward(model, x, y)  # step 1 (warm-up): compiles
    for hook in rt.step_hooks:
        hook(SimpleNamespace(step=1))
    rt.forward(model, x, y)  # step 2, same shape: no new graph
    model.eval()
    with torch.no_grad():
        rt.forward(model, x, y)  # a validation forward: its own graph, allowed
    model.train()
    small = torch.nn.functional.avg_pool2d(x, 2), torch.nn.functional.avg_pool2d(y, 2)
    with pytest.raises(RuntimeError, match="captured 1 new graph.* step 2, after 1 warm-up"):
        rt.forward(model, *small)


def test_fsdp_with_checkpoint_is_refused_with_compile():
    """Each pair trains (tests/test_distributed_spawn.py, this file); the three together hit
    TorchDynamo's recompile limit in the first step, so they are refused before building."""
    cfg = cpu_config(["compile:backend=aot_eager", "fsdp", "checkpoint"], batch_size=2)
    cfg.world_size = 2
    with pytest.raises(ConfigError, match="compile with fsdp and checkpoint together"):
        make_plan(cfg)
    cfg.techniques = ["compile:backend=aot_eager", "fsdp"]
    make_plan(cfg)


def _step_in_float64(model):
    """One forward + backward of the smooth loss on the fixed batch: gradients, the bytes of
    the distinct storages saved for backward, and the buffers (BatchNorm running statistics)."""
    x, y = _batch(torch.float64)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return grads, sum(saved.values()), {n: b.clone() for n, b in model.named_buffers()}


def _compiled_step(techniques: list[str]):
    from memstudy.techniques.compose import build_pipeline

    build = build_pipeline(make_plan(cpu_config(techniques)))  # resets Dynamo
    build.model.double()  # before the first call: the graphs are traced in float64
    return _step_in_float64(build.model)


@pytest.fixture(scope="module")
def plain_and_compiled():
    from memstudy.models import build_unet

    return (_step_in_float64(build_unet(None, seed=0).double()),
            _compiled_step(["compile:backend=aot_eager_decomp_partition"]))


# the compiled graph's saved bytes with checkpoint, as a fraction of compile alone's, at most
# (measured at 192 px: block 0.73, selective 0.84, sqrt 0.67; Inductor at block: 0.73)
SAVED_FRACTION = 0.9


@pytest.mark.parametrize("placement", ["block", "selective", "sqrt"])
def test_compile_with_checkpoint_equals_the_plain_model(placement, plain_and_compiled):
    """compile + checkpoint: TorchDynamo captures the regions, AOTAutograd's min-cut partitioner
    (aot_eager_decomp_partition: Inductor's partition without kernel generation) recomputes
    them in backward. In float64 the gradients and BatchNorm's running statistics after one
    step equal the plain eager model's (running statistics updated once, not again by the
    recomputation), and the graph saves less than compile alone."""
    (grads, _, buffers), (_, compiled_saved, _) = plain_and_compiled
    ours, saved, our_buffers = _compiled_step(["compile:backend=aot_eager_decomp_partition",
                                               f"checkpoint:{placement}"])
    assert compiled_graphs() > 0, "the model was not compiled"
    assert _relative_l2(ours, grads) <= GRAD_TOLERANCE
    for name, value in buffers.items():
        torch.testing.assert_close(our_buffers[name], value, rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"{name}: {m}")
    assert saved <= SAVED_FRACTION * compiled_saved


def test_the_tensor_meter_is_refused_with_compile():
    with pytest.raises(ConfigError, match="set meter.tensor = 'off'"):
        make_plan(small_config(techniques=["compile"]))  # auto: on for the CPU
    cfg = cpu_config(["compile"])
    cfg.budget = "2GiB"
    with pytest.raises(ConfigError, match="compile with a CPU budget"):
        make_plan(cfg)


def test_shapes_that_would_recompile_are_refused():
    cfg = cpu_config(["compile"], batch_size=2)
    cfg.data.train_images = 3
    with pytest.raises(ConfigError, match="data.train_images = 3 leaves a last batch of 1"):
        make_plan(cfg)
    with pytest.raises(ConfigError, match="train.warmup_steps >= 1"):
        make_plan(cpu_config(["compile"], warmup_steps=0))


def test_missing_cpp_compiler_is_refused(monkeypatch):
    from torch._inductor import cpp_builder

    def no_compiler():
        raise RuntimeError("no C++ compiler found")  # what Inductor raises, simulated

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        make_plan(cpu_config(["compile"]))
    make_plan(cpu_config(["compile:backend=aot_eager"]))  # needs none


def test_memory_budget_is_set_for_the_partitioner():
    from memstudy.techniques.compose import build_pipeline

    build_pipeline(make_plan(cpu_config(["compile:memory_budget=0.25"])))
    assert torch._functorch.config.activation_memory_budget == 0.25
    build_pipeline(make_plan(cpu_config(["compile"])))
    assert torch._functorch.config.activation_memory_budget == 1.0  # not inherited


@functools.cache
def _cuda_run(techniques: tuple[str, ...], size: int = 1024):
    """Figures of a short CUDA run of the user network (compile and checkpoint:modules act on
    any network). Runs the tests share are made once."""
    cfg = small_config(size, techniques=list(techniques), max_steps=5, validate=False)
    cfg.train.device = "cuda"
    cfg.data.train_images = 5
    _user_network(cfg)
    # contiguous: a recomputed ConvTranspose2d backward on channels_last CUDA tensors fails
    # Inductor's stride check (pytorch/pytorch#171622; docs/techniques/compile.md)
    cfg.train.channels_last = False
    rec = execute(cfg, db=None)
    assert rec.status == "ok", (techniques, rec.failed_phase, rec.error)
    return {(phase, name): value for _, phase, name, value in rec.metrics}


@pytest.mark.gpu
@pytest.mark.slow
def test_memory_budget_lowers_saved_activations_on_cuda():
    full = _cuda_run(("amp:bf16", "compile"))
    budget = _cuda_run(("amp:bf16", "compile:memory_budget=0.2"))
    assert budget[("forward", "saved_bytes")] < 0.8 * full[("forward", "saved_bytes")]
    assert full[("run", "compile_time_s")] > 0


@pytest.mark.gpu
def test_compile_composes_with_offload_on_cuda():
    figures = _cuda_run(("amp:bf16", "offload", "compile"))
    assert figures[("forward", "saved_host_bytes")] > 0  # offload's hooks saw the compiled graph


@pytest.mark.gpu
def test_compile_with_checkpoint_saves_less_on_cuda():
    """Inductor on the GPU: the checkpointed regions are recomputed inside the compiled
    backward, so the forward saves less than compile alone (on the CPU: 0.56)."""
    alone = _cuda_run(("amp:bf16", "compile"))
    with_checkpoint = _cuda_run(("amp:bf16", "compile", "checkpoint:modules"))
    assert (with_checkpoint[("forward", "saved_bytes")]
            < SAVED_FRACTION * alone[("forward", "saved_bytes")])


@pytest.mark.parametrize("tile", ["tile:3:keep=all"])
def test_compile_with_tile_equals_the_plain_model(tile, plain_and_compiled):
    """compile + tile + checkpoint: the untiled levels' modules compiled (their checkpointed
    blocks recomputed by the partitioner), the tiled regions eager. In float64 the gradients
    and running statistics equal the plain eager model's; only the untiled modules are
    compiled (the tiled regions are not traced). levels=3 with layer1 cut: the GPU test
    (tests/test_tile_fast_gpu.py), with Inductor."""
    from memstudy.techniques.compose import build_pipeline

    (grads, _, buffers), _ = plain_and_compiled
    build = build_pipeline(make_plan(cpu_config(
        ["compile:backend=aot_eager_decomp_partition", "checkpoint", tile])))
    # layer1..4 and decoder blocks 0-2 at levels=2; layer1 and block 2 are tiled at levels=3
    assert build.notes["compile"]["modules"] == (5 if "levels=3" in tile else 7)
    build.model.double()
    ours, _, our_buffers = _step_in_float64(build.model)
    assert compiled_graphs() > 0, "nothing was compiled"
    assert _relative_l2(ours, grads) <= GRAD_TOLERANCE
    for name, value in buffers.items():
        torch.testing.assert_close(our_buffers[name], value, rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("techniques, owners", [
    (["checkpoint", "tile:3:keep=all"], 7 + 16 + 3),  # parts, BasicBlocks, decoder blocks 0-2
    (["checkpoint"], 1 + 16 + 5),  # the model, BasicBlocks, decoder blocks
    ([], 1),
])
def test_recompile_limit_covers_every_instance_of_a_shared_forward(techniques, owners):
    """Instances share a code object (tile's four residual stages share Sequential.forward; the
    checkpointed blocks share checkpoint's wrapper, each a frame of its own after a graph
    break): 8 graphs each before the run fails. On an H100 the default 8 for all of them
    stopped compile + checkpoint + tile in its first step (FailOnRecompileLimitHit)."""
    import torch._dynamo

    from memstudy.techniques.compose import build_pipeline

    build_pipeline(make_plan(cpu_config(["compile:backend=aot_eager", *techniques])))
    assert torch._dynamo.config.recompile_limit == 8 * owners
