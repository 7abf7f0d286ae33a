"""Model FLOPs of one training step, for achieved-throughput and MFU figures.

Counted once per (batch, size) by torch.utils.flop_counter on the meta device: shapes only,
no memory, no compute. These are *model* FLOPs (forward + backward of the plain U-Net), the
MFU convention: recomputation by checkpointing or invertible blocks is work the technique
adds, not useful work, so it is not counted.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.flop_counter import FlopCounterMode

from memstudy.models import ContrastUNet


@functools.lru_cache(maxsize=8)
def model_flops_per_step(batch_size: int, image_size: int) -> int:
    model = ContrastUNet().to("meta")
    x = torch.empty(batch_size, 1, image_size, image_size, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops()
