"""Shared fixtures. CPU by default; `gpu` / `multigpu` tests skip without the hardware."""
from __future__ import annotations

import ast
import functools
import os
from pathlib import Path


def _threads_per_worker() -> int:
    """This process's share of the cores: all of them alone, cores / workers under xdist.
    Two workers of two threads each on two cores run 5x slower, not 2x (OpenMP threads wait
    on each other's barriers; measured on the 2-core CI machine: a lowrank step's SVDs 64 s
    instead of 13 s, a checkpoint run 5.7 s instead of 1.2 s)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (cores or 1) // workers)


SIDE_BY_SIDE = "PYTEST_XDIST_WORKER" in os.environ  # this process is one of several workers

# In each xdist worker, before torch starts its thread pool; subprocesses the tests start
# (CLI runs, gloo ranks) inherit it. An OMP_NUM_THREADS set by the user is kept.
if SIDE_BY_SIDE:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads_per_worker()))

import pytest  # noqa: E402
import torch  # noqa: E402

from memstudy.config import RunConfig  # noqa: E402

if "OMP_NUM_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _uses_module_setup(item) -> bool:
    """Whether the test uses a fixture its own module defines with a scope wider than one test
    (a spawn of gloo ranks, a compiled model): made once for all the module's tests that use
    it, as long as they run one after another in one process."""
    module = item.nodeid.split("::")[0]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        if defs and defs[-1].scope != "function" and defs[-1].baseid == module:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))
    # The `slow` tests (whole training runs, an Inductor compilation, grids of CLI processes: up
    # to 2 minutes each on 2 cores) first, so that none of them starts last and runs on alone
    # while the other worker has nothing left; one that uses its module's shared setup stays
    # with the module's other tests, so that the setup is made once.
    first = [it for it in items if it.get_closest_marker("slow") and not _uses_module_setup(it)]
    moved = set(first)
    items[:] = first + [it for it in items if it not in moved]


@functools.cache
def _shares_setup(path: str) -> bool:
    """Whether the test module at `path` defines a fixture with a scope wider than one test, or
    a cached function its tests share (tests/test_tiling.py's untiled float64 steps: split over
    two workers, each worker computed and held them, and two workers of ~10 GiB each outgrew
    the 24 GiB CI machine)."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        for decorator in getattr(node, "decorator_list", ()):
            if "lru_cache" in ast.unparse(decorator):
                return True
            if "fixture" not in ast.unparse(decorator):
                continue
            for kw in getattr(decorator, "keywords", ()):
                if kw.arg == "scope" and getattr(kw.value, "value", "function") != "function":
                    return True
    return False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (dev/test): xdist's `load` scheduling, except that a module with a setup its tests
    share (tests/test_distributed_spawn.py's spawn of gloo ranks: 1.5 minutes on 2 cores) goes
    to one worker as a whole: `load` sends consecutive tests in chunks, and a chunk boundary
    inside such a module made the setup on both workers (daso's 4-process spawn did). Those
    modules start first, those with the most tests first; then the other tests one at a time in
    collection order (the `slow` ones first). xdist's own `--dist loadgroup` would do this with
    `xdist_group` marks, but with pytest 9.2 it silently stops grouping (pytest-xdist #1386)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedSetupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return module if _shares_setup(str(config.rootpath / module)) else nodeid

    return SharedSetupScheduling(config, log)


def small_config(size: int = 192, techniques: list[str] | None = None, **train) -> RunConfig:
    """A config that trains in seconds on the CPU: few phantoms, one epoch, no warm-up waste."""
    cfg = RunConfig(techniques=list(techniques or []))
    cfg.train.image_size = size
    cfg.train.device = "cpu"
    cfg.train.epochs = 1
    cfg.train.warmup_steps = 1
    cfg.train.measure_steps = 1
    cfg.data.train_images = 2
    cfg.data.val_images = 1
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


@pytest.fixture
def make_config():
    return small_config


def reset_cuda_state() -> None:
    """What one GPU test may leave behind that changes the next one's figures or outcome, put
    back to PyTorch's defaults: a memory cap (`--budget` sets the allocator's fraction; a later
    test then hit it and retried, `test_cuda_run_is_tuned_and_records_fragmentation` failed
    after the tests before it), cuDNN / TF32 flags, peak statistics, cached blocks and
    Dynamo's compiled code."""
    import gc
    import sys

    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = False
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = False
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    devices = range(torch.cuda.device_count())
    if any(torch.cuda.memory_allocated(index) for index in devices):
        gc.collect()  # tensors a test left in reference cycles (0.2 s a collection: only then)
    for index in devices:
        torch.cuda.synchronize(index)
        torch.cuda.set_per_process_memory_fraction(1.0, index)
        torch.cuda.reset_peak_memory_stats(index)
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _device_wide_readings_run_alone(request, monkeypatch):
    """GPU tests run side by side on one GPU under `-n` (dev/test, benchmarks/gpu.sh), which is
    sound for what a process measures of itself (its allocator's peaks) but not for NVML's used
    memory, which is the whole device's: a budget's CUDA-context measurement would count the
    neighbours' memory. Tests that read the whole device are marked `alone` and run one at a
    time after the others; an unmarked GPU test that reaches the budget's NVML reading while
    side by side fails here, naming the mark."""
    if not SIDE_BY_SIDE or not ({"gpu", "multigpu"} & set(request.keywords)):
        return
    if "alone" in request.keywords:
        pytest.skip("measures the whole device: run it without -n (dev/test and "
                    "benchmarks/gpu.sh run the `alone` tests one at a time after the others)")
    import memstudy.budget

    def whole_device(index: int) -> int:
        raise AssertionError(f"{request.node.nodeid} reads the whole device's used memory "
                             "(a budget's CUDA context), which the tests beside it change: "
                             "mark it @pytest.mark.alone")

    monkeypatch.setattr(memstudy.budget, "nvml_used", whole_device)
    # a run's NVML baseline, read as its process first touches CUDA, would count the
    # neighbours' memory too: left unknown here (0, which counts against a budget: the safe
    # side), so only a test whose figures need the whole device must run alone
    monkeypatch.setattr(memstudy.budget, "note_baseline", lambda index: None)


@pytest.fixture(autouse=True)
def _gpu_test_starts_clean(request):
    """Each GPU test independent of those run before it in the same process."""
    if not ({"gpu", "multigpu"} & set(request.keywords)):
        yield
        return
    reset_cuda_state()
    yield
    reset_cuda_state()
