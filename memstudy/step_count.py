"""How many optimizer steps a run takes: arithmetic on the run's settings and two numbers the
techniques declare (whether ranks shard each global batch, micro-batches per step).

It lives with the settings, below everything, so any layer may ask it; the registry
(`memstudy.techniques.planned_steps`) supplies the declared numbers from a technique list.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memstudy.config import TrainConfig


def planned_steps(train: "TrainConfig", train_images: int, *, shards_batch: bool,
                  micro_batches: int) -> int:
    """Optimizer steps of `train.epochs` epochs over `train_images` images, each step
    `micro_batches` micro-batches of `train.batch_size` images, capped by train.max_steps.

    Data-parallel ranks that shard each global batch drop an incomplete last one (so every
    rank steps); otherwise the last, smaller batch is a step of its own."""
    if shards_batch:
        pieces = train_images // train.batch_size
    else:
        pieces = math.ceil(train_images / train.batch_size)
    per_epoch = math.ceil(pieces / micro_batches)
    return min(train.epochs * per_epoch, train.max_steps or math.inf)
