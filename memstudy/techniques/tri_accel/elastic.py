"""Memory-elastic batch size: a VRAM feedback controller and the memory readings it uses.

B(t+1) = B + delta_up when usage < rho_low * capacity, B - delta_down when usage > rho_high *
capacity, else B. Usage is the peak over the control window, not the level between steps
(activations are freed by then). An out-of-memory error from a grown batch is survivable:
`on_oom` shrinks the batch and caps later growth below the size that failed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from memstudy.budget import process_device_bytes
from memstudy.env import indexed_device


@dataclass
class ElasticBatch:
    batch: int
    rho_low: float
    rho_high: float
    delta_up: int
    delta_down: int
    max_batch: int
    ceiling: int | None = None  # largest batch still allowed after an out-of-memory error

    def decide(self, used: float, capacity: float) -> int:
        fraction = used / capacity
        if fraction < self.rho_low:
            limit = min(self.max_batch, self.ceiling or self.max_batch)
            self.batch = max(self.batch, min(self.batch + self.delta_up, limit))
        elif fraction > self.rho_high:
            self.batch = max(1, self.batch - self.delta_down)
        return self.batch

    def on_oom(self) -> bool:
        """Shrink after an out-of-memory error; False when already at batch 1 (nothing to do)."""
        if self.batch <= 1:
            return False
        failed = self.batch
        self.batch = max(1, failed - self.delta_down)
        self.ceiling = min(self.ceiling or failed, failed - 1)
        return True


class CudaMemory:
    """Window peak of the allocator's reserved bytes, plus what NVML sees beyond the allocator
    (CUDA context, other processes); capacity is the budget or the device's total memory."""

    def __init__(self, device: torch.device, budget_bytes: int | None):
        self.device = device
        self.capacity = budget_bytes or torch.cuda.get_device_properties(device).total_memory

    def read(self) -> float:
        reserved = torch.cuda.memory_reserved(self.device)
        outside = max(0, process_device_bytes(indexed_device(self.device).index) - reserved)
        used = torch.cuda.max_memory_reserved(self.device) + outside
        torch.cuda.reset_peak_memory_stats(self.device)  # next window starts now
        return float(used)


class MeterMemory:
    """On the CPU: the peak live tensor bytes seen by memstudy's budget meter in the window."""

    def __init__(self, meter: Callable[[], object], budget_bytes: int):
        self.meter = meter  # returns the LiveTensorMeter the runner attached to the runtime
        self.capacity = budget_bytes

    def read(self) -> float:
        meter = self.meter()
        if meter is None:
            raise RuntimeError("tri_accel elastic on the CPU needs the budget tensor meter; run "
                               "through memstudy.runner.execute with budget set")
        used = meter.peak
        meter.reset_peak()
        return float(used)
