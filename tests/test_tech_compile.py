"""compile: a compiled step computes what the eager step computes; every bad option or
unsupported combination is refused by name before anything is built."""
from __future__ import annotations

import pytest
import torch

from conftest import small_config
from memstudy.config import MeterConfig
from memstudy.errors import ConfigError
from memstudy.meters import PhaseRecorder
from memstudy.runner import execute
from memstudy.techniques.compose import make_plan

# Inductor's fused CPU kernels reorder float32 sums (BatchNorm statistics, convolution
# reductions, the loss's filters); measured at 192 px the largest gradient difference is
# ~1e-4 of the largest gradient of the same parameter, so the check allows 2e-3 of it.
GRAD_TOLERANCE = 2e-3
LOSS_TOLERANCE = 1e-5


def _dynamo_frames() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def cpu_config(techniques: list[str], **train):
    cfg = small_config(techniques=techniques, **train)
    cfg.meter.tensor = "off"  # a dispatch mode would make Dynamo run eagerly (refused)
    return cfg


def measured_step(techniques: list[str]):
    """One measured forward + backward at 192 px on a fixed batch: loss, gradients, forward
    figures and the build."""
    from memstudy.techniques.compose import build_pipeline

    build = build_pipeline(make_plan(cpu_config(techniques)))
    recorder = PhaseRecorder(build.device, build.model, build.runtime, lambda: None,
                             MeterConfig(tensor="off"))
    gen = torch.Generator().manual_seed(7)
    x, y = torch.rand(1, 1, 192, 192, generator=gen), torch.rand(1, 1, 192, 192, generator=gen)
    recorder.in_warmup = False
    with recorder.step(measured=True):
        with recorder.phase("forward"):
            loss = build.runtime.forward(build.model, x, y)
        with recorder.phase("backward"):
            build.runtime.backward(loss)
    grads = {n: p.grad.detach().clone() for n, p in build.model.named_parameters()}
    return loss.item(), grads, recorder.summary()["forward"], build


@pytest.mark.slow
def test_compiled_step_runs_on_the_cpu_with_eager_gradients():
    """Inductor on the CPU (C++ kernels); compile time on 2 cores is about a minute."""
    import torch._dynamo

    torch._dynamo.reset()
    eager_loss, eager_grads, _, _ = measured_step([])
    graphs_before = _dynamo_frames()
    loss, grads, forward, build = measured_step(["compile"])
    assert _dynamo_frames() > graphs_before, "the model was not compiled"
    assert build.notes["compile"]["mode"] == "default"
    assert loss == pytest.approx(eager_loss, rel=LOSS_TOLERANCE)
    assert grads.keys() == eager_grads.keys()  # compiled in place: same names
    worst = 0.0
    for name, grad in eager_grads.items():
        scale = grad.abs().max().item() or 1.0
        worst = max(worst, (grads[name] - grad).abs().max().item() / scale)
    assert worst <= GRAD_TOLERANCE, worst
    # the measured step saw what the compiled graph saves for backward
    assert forward["saved_bytes"] > 0


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
                                        "fullgraph=False:loss=True:backend=aot_eager"]


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
