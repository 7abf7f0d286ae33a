"""Shared fixtures. CPU by default; `gpu` / `multigpu` tests skip without the hardware."""
from __future__ import annotations

import os

import pytest
import torch

from memstudy.config import RunConfig

os.environ.setdefault("OMP_NUM_THREADS", "2")


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
