"""compile: `torch.compile` of the model: fused kernels and a memory-budgeted choice of what to
save for backward.

Memory / compute trade-off. TorchDynamo captures the forward as a graph, AOTAutograd derives
the backward and splits the joint graph into a forward and a backward with the min-cut
partitioner, and Inductor generates fused kernels (Triton on a GPU, C++/OpenMP on the CPU).
- Time: fused pointwise ops (BatchNorm, ReLU, additions) read and write memory once instead
  of once per op; `mode` trades compile time for run time (autotuned
  matmul/convolution templates, CUDA graphs that remove launch overhead).
- Memory: the partitioner saves for backward only what is cheaper to keep than to recompute;
  fused intermediates are never materialised. `memory_budget` (PyTorch's
  `torch._functorch.config.activation_memory_budget`) caps the saved activations at that
  fraction of what the default partition saves: below 1.0 the partitioner recomputes the ops
  that free the most memory per FLOP in backward, automatically, like a selective
  activation checkpoint that needs no placement. 0 recomputes everything it can.
- Cost: compilation (tens of seconds to minutes) in the first step, which is a warm-up step:
  `first_step_time_s` holds it and `compile_time_s` is its excess over a plain step
  (docs/metrics.md). The first validation pass compiles the eval-mode graph; its time (and,
  under `max-autotune`, its autotuning buffers) are in the validation figures.

With `checkpoint`, TorchDynamo captures each region as a checkpoint higher-order op and
AOTAutograd tags its nodes for recomputation: the partitioner keeps only the region inputs
(the convolution outputs too with `selective`) and recomputes the rest inside the compiled
backward. BatchNorm's running-statistics update is a mutation that functionalization applies
once, at the end of the forward graph, so the recomputation does not update them a second time
(eager checkpoint needs its momentum-0 recompute context for that; tests/test_tech_compile.py
compares gradients and running statistics with the plain eager model). `memory_budget` then
acts on what remains outside the regions.

With `tile`, the tiled levels run through tile's own autograd Functions (sweeps over strips,
statistics as explicit tensors), which TorchDynamo does not trace: compile then compiles the
modules that run below them through their own forward (`TiledForward.untiled_modules`: the
residual stages and the untiled decoder blocks, each one graph), and the tile bodies stay eager
or, with tile:graphs, replay as CUDA graphs. The untiled levels are where a tiled step's
BatchNorm and ReLU kernels are largest, so that is where fusion pays.

With `fsdp`, fully_shard registers its hooks on the compiled module and on each U-Net block
inside it; TorchDynamo does not trace FSDP's hooks (torch._dynamo.config.skip_fsdp_hooks), so
the model runs as one graph per FSDP unit (15 on the U-Net), the all-gathers and
reduce-scatters eager between them. `daso` averages parameters in its optimizer step, outside
the compiled forward and backward.

How: `nn.Module.compile` compiles the model in place (same module, same parameter names, so
the PARALLEL stage and the meters see the module they expect). offload's saved-tensor hooks
act on what the compiled graph saves. The loss stays eager: memstudy's MS-SSIM loss notifies
the loss meter during measured steps and, chunked (train.loss_chunk_rows), calls
torch.autograd.grad itself; TorchDynamo would break the graph there and recompile when the
meter subscribes, so a compiled loss would be measured in another form than it is timed.

Refused (with the reason in the message): combinations whose inputs change shape or whose
code changes between steps (tri_accel's elastic batch and per-unit precision, a last batch
of another size, native image sizes: each would recompile inside the measured or timed
steps, or silently fall back to eager after the recompile limit; whatever else recompiles
after warm-up stops the run, `RecompileGuard`), structures it cannot trace
faithfully here (invertible, quantization, mp, pipeline; any technique not in
COMPOSES_WITH is refused until verified), CUDA graphs where they
cannot work (on the CPU, with offload's host copies), and a missing backend (no C++ compiler
for Inductor on the CPU, no usable Triton on the GPU).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from memstudy.env import compute_capability
from memstudy.errors import ConfigError
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import CompileOptions as Options

CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # these modes capture CUDA graphs
# Backends whose partition is the min-cut one, where activation_memory_budget applies.
MINCUT_BACKENDS = ("inductor", "aot_eager_decomp_partition")
# Techniques verified to compose with compile (tests/test_tech_compile.py, the registry
# test, tests/test_distributed_spawn.py for fsdp / daso, benchmarks/bench_compile.py); any
# other is refused by name.
COMPOSES_WITH = ("amp", "checkpoint", "offload", "dp", "zero", "fsdp", "daso", "allocator", "tile")
# Why some cannot be compiled faithfully here.
NOT_COMPOSABLE = {
    "tri_accel": "its elastic batch changes the input shape and its adaptive precision the "
                 "autocast of each unit between steps (each change recompiles inside timed "
                 "steps), and its curvature needs double backward, which compiled graphs do "
                 "not support",
    "invertible": "momentumnet's reversible blocks rebuild activations in a hand-written "
                  "autograd.Function backward; memstudy has not verified that a compiled "
                  "graph keeps what they save and their gradients",
    "quantization": "eager-mode QAT's observers switch behaviour on tensor flags "
                    "(freeze_after), which breaks the graph at every fake quantizer",
    "mp": "model parallelism sends activations between devices or processes inside the "
          "forward, which the compiled graph would split at every transfer",
    "pipeline": "pipeline schedules run the stages themselves (torch.distributed.pipelining)",
}


def check(opts: Options, plan: Plan) -> None:
    _check_options(opts, plan)
    _check_meters(plan)
    _check_combination(plan)
    _check_shapes(opts, plan)
    _check_backend(opts, plan)


def _check_options(opts: Options, plan: Plan) -> None:
    if not 0.0 <= opts.memory_budget <= 1.0:
        raise ConfigError(f"compile: memory_budget={opts.memory_budget} must be within 0..1 "
                          "(1.0 = PyTorch's default partition, 0 = recompute all it can)")
    if opts.backend != "inductor" and opts.mode != "default":
        raise ConfigError(f"compile: mode={opts.mode} is an Inductor mode but backend="
                          f"{opts.backend}; use backend=inductor or mode=default")
    if opts.memory_budget < 1.0 and opts.backend not in MINCUT_BACKENDS:
        raise ConfigError(f"compile: memory_budget applies in the min-cut partitioner, which "
                          f"backend={opts.backend} does not use; use backend=inductor (or "
                          "aot_eager_decomp_partition) or memory_budget=1.0")
    if opts.mode in CUDAGRAPH_MODES:
        if plan.device.type != "cuda":
            raise ConfigError(f"compile: mode={opts.mode} captures CUDA graphs but train.device "
                              f"resolves to {plan.device}; use mode=default or "
                              "max-autotune-no-cudagraphs")
        if plan.has("offload"):
            raise ConfigError(f"compile: mode={opts.mode} captures CUDA graphs, which cannot "
                              "hold offload's copies to host memory (PyTorch would silently "
                              "skip the graphs); use mode=default or max-autotune-no-cudagraphs")
    # the first step compiles; CUDA-graph trees warm up, record, then replay (steps 1-3)
    need = 3 if opts.mode in CUDAGRAPH_MODES else 1
    if plan.config.train.warmup_steps < need:
        raise ConfigError(f"compile:mode={opts.mode} needs train.warmup_steps >= {need} (got "
                          f"{plan.config.train.warmup_steps}): compilation"
                          f"{' and CUDA-graph recording' if need > 1 else ''} would land in a "
                          f"measured step; set --set train.warmup_steps={need}")


def _check_meters(plan: Plan) -> None:
    """The tensor meter is a TorchDispatchMode; while one is active TorchDynamo runs frames
    eagerly, so measured steps would measure the eager model (silently)."""
    meter = plan.config.meter.tensor
    if meter == "on" or (meter == "auto" and plan.device.type != "cuda"):
        raise ConfigError(f"compile with the tensor meter (meter.tensor = {meter!r}, on for the "
                          "CPU by default): TorchDynamo does not compile under a dispatch mode, "
                          "so measured steps would run the model eagerly; set meter.tensor = "
                          "'off'")
    if plan.config.budget is not None and plan.device.type != "cuda":
        raise ConfigError("compile with a CPU budget: the budget is enforced by the tensor meter "
                          "on every step, under which TorchDynamo does not compile; drop budget "
                          "or compile")


def _check_combination(plan: Plan) -> None:
    offload = plan.chosen.get("offload")
    if offload is not None and offload.which == "boundaries":
        raise ConfigError("compile with offload:which=boundaries: checkpoint marks its region "
                          "inputs on the eager tensors, while the compiled graph saves tensors "
                          "of its own, none marked, so nothing would be offloaded; use "
                          "offload:which=all or drop compile")
    if plan.has("fsdp") and plan.has("checkpoint"):
        # seen on two gloo processes: FSDP's hooks break the graph at every block, so each
        # checkpointed block's forward is a frame of its own, and these share one code object
        raise ConfigError("compile with fsdp and checkpoint together: FSDP's hooks split the "
                          "graph at every block, and the checkpointed blocks' forwards (one "
                          "code object) recompile per block past TorchDynamo's recompile limit; "
                          "drop one of compile, fsdp, checkpoint")
    for name in plan.chosen:
        if name == "compile" or name in COMPOSES_WITH:
            continue
        why = NOT_COMPOSABLE.get(name, "memstudy has not verified that a compiled graph "
                                       f"computes and saves what {name} does")
        raise ConfigError(f"compile with {name} is not supported: {why}; drop compile or {name}")


def _check_shapes(opts: Options, plan: Plan) -> None:
    """Refuse runs whose training batches change shape: each new shape recompiles (dynamic or
    not: a batch of one is specialised) inside the timed steps."""
    train, data = plan.config.train, plan.config.data
    if train.image_size == "native":
        raise ConfigError("compile with train.image_size = native: every image size is a new "
                          "shape to compile; use a fixed train.image_size or drop compile")
    # data parallel techniques drop an incomplete last global batch
    if not plan.shards_batch() and data.train_images % train.batch_size:
        raise ConfigError(f"compile: data.train_images = {data.train_images} leaves a last batch "
                          f"of {data.train_images % train.batch_size} image(s) at train.batch_size "
                          f"= {train.batch_size}, which would recompile in a timed step; make "
                          "data.train_images a multiple of train.batch_size")


def _check_backend(opts: Options, plan: Plan) -> None:
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError("compile: torch.compile (TorchDynamo) is not supported on this Python/"
                          "PyTorch; drop compile")
    if opts.backend != "inductor":
        return
    if plan.device.type == "cuda":
        problem = triton_cuda_problem(plan.device)
        if problem is not None:
            raise ConfigError(f"compile: Inductor needs Triton for CUDA kernels, but {problem}; "
                              "install triton, or use compile:backend=aot_eager")
        return
    cxx = cpp_compiler()
    if cxx is None:
        raise ConfigError("compile: Inductor's CPU backend needs a C++ compiler (g++ or clang++; "
                          "torch._inductor.config.cpp.cxx or $CXX) and none was found; install "
                          "one, or use compile:backend=aot_eager")


def triton_cuda_problem(device: torch.device) -> str | None:
    """Why Inductor could not generate Triton kernels for `device`, or None; read without
    initialising CUDA. torch's has_triton() reads the GPU's properties, which starts CUDA, and
    checks run before the allocator technique configures the caching allocator in the run's
    process (compose.prepare_process), which CUDA must not have started by then (seen on an
    H100: every compile+allocator maxres probe was refused). So before CUDA starts: the
    package, and the compute capability from NVML (env.compute_capability)."""
    from torch.utils._triton import has_triton, has_triton_package

    if not has_triton_package():
        return "the triton package is not installed"
    if torch.cuda.is_initialized():
        return None if has_triton() else "Triton reports no usable backend for this GPU"
    capability = compute_capability(device)
    if capability is not None and capability < (7, 0):
        return (f"the GPU's compute capability {capability[0]}.{capability[1]} is below the "
                "7.0 Triton needs")
    return None


def cpp_compiler() -> str | None:
    """The C++ compiler Inductor would use on the CPU, or None."""
    from torch._inductor import cpp_builder

    try:
        return cpp_builder.get_cpp_compiler()
    except Exception:  # noqa: BLE001 - Inductor raises its own error types for "not found"
        return None


def apply(opts: Options, build: Build) -> None:
    import torch._dynamo

    # Each run compiles from scratch: graphs of an earlier run in this process (tests,
    # notebooks) would otherwise count towards the recompile limit of the same code.
    torch._dynamo.reset()
    # Past that limit Dynamo silently runs the frame eagerly; a study must fail instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # Read by AOTAutograd's partitioner when the graphs compile (the first step). Set on every
    # compile run so that a run never inherits an earlier run's budget in this process.
    torch._functorch.config.activation_memory_budget = opts.memory_budget
    kwargs = {"dynamic": opts.dynamic, "fullgraph": opts.fullgraph, "backend": opts.backend}
    if opts.backend == "inductor":
        kwargs["mode"] = opts.mode
    parts = compiled_modules(build.model)
    # Dynamo's recompile limit counts graphs per code object, and module instances share
    # theirs: the compiled parts (tile's 4 residual stages share Sequential.forward) and,
    # where a graph break splits them into frames of their own (seen on CUDA with checkpoint),
    # every block whose forward checkpoint replaced (19 share its wrapper). 8 graphs per
    # instance (PyTorch's default for one) before the run fails; RecompileGuard still stops a
    # run that compiles anything after warm-up.
    torch._dynamo.config.recompile_limit = 8 * frame_owners(parts)
    for module in parts:
        module.compile(**kwargs)
    guard = RecompileGuard(build.model, build.config.train.warmup_steps)
    build.runtime.forward_contexts.append(guard.forward)
    build.runtime.step_hooks.append(guard.on_step)
    build.notes["compile"] = {"mode": opts.mode, "memory_budget": opts.memory_budget,
                              "dynamic": opts.dynamic, "fullgraph": opts.fullgraph,
                              "backend": opts.backend,
                              "modules": len(parts)}


def compiled_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model, or with tile (whose regions Dynamo does not trace) the modules that run
    below the tiled levels."""
    tiled = getattr(model, "forward_padded", None)
    return tiled.untiled_modules() if hasattr(tiled, "untiled_modules") else [model]


def frame_owners(parts: list[torch.nn.Module]) -> int:
    """Module instances that may each be compiled as frames of one shared code object: the
    compiled parts, and the modules inside them whose `forward` an instance attribute
    replaced (checkpoint's regions)."""
    return len(parts) + sum("forward" in vars(m) for part in parts for m in part.modules())


def compiled_graphs() -> int:
    """Graphs TorchDynamo has captured in this process (first compilations and recompilations)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class RecompileGuard:
    """Fails a training forward after warm-up in which TorchDynamo captured a new graph.

    The checks refuse what is known to change shapes or code between steps; this catches the
    rest (a guard that fails on some flag or attribute): below Dynamo's recompile limit a
    recompilation is silent, and its compile time would land in a measured or timed step.
    Validation forwards (eval mode, compiled once at the first validation) are not checked."""

    def __init__(self, model: torch.nn.Module, warmup_steps: int):
        self.model, self.warmup_steps, self.steps_done = model, warmup_steps, 0

    def on_step(self, info) -> None:
        self.steps_done = info.step

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        before = compiled_graphs()
        yield
        new = compiled_graphs() - before
        if new and self.model.training and self.steps_done >= self.warmup_steps:
            raise RuntimeError(
                f"compile: TorchDynamo captured {new} new graph(s) in the forward of step "
                f"{self.steps_done + 1}, after {self.warmup_steps} warm-up step(s): a "
                "recompilation inside the measured steps (set TORCH_LOGS=recompiles to see "
                "which guard failed); the run stops rather than time compilation as training")


register(Technique("compile", Stage.COMPILE, Options,
                   "torch.compile: fused kernels; memory_budget recomputes in backward to cap "
                   "saved activations", apply, check, compiles=True))
