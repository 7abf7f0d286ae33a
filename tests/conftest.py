"""Shared fixtures. CPU by default; `gpu` / `multigpu` tests skip without the hardware."""
from __future__ import annotations

import os


def _threads_per_worker() -> int:
    """This process's share of the cores: all of them alone, cores / workers under xdist.
    Two workers of two threads each on two cores run 5x slower, not 2x (OpenMP threads wait
    on each other's barriers; measured on the 2-core CI machine: a lowrank step's SVDs 64 s
    instead of 13 s, a checkpoint run 5.7 s instead of 1.2 s)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (cores or 1) // workers)


# In each xdist worker, before torch starts its thread pool; subprocesses the tests start
# (CLI runs, gloo ranks) inherit it. An OMP_NUM_THREADS set by the user is kept.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads_per_worker()))

import pytest  # noqa: E402
import torch  # noqa: E402

from memstudy.config import RunConfig  # noqa: E402

if "OMP_NUM_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


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
