"""Per-unit precision: gradient-variance EMA, threshold assignment, per-module autocast.

Each unit's forward runs under its own `torch.autocast` (FP16 or BF16), or with autocast
disabled and its inputs cast to float32 (FP32). Parameters and their gradients stay float32
(the master copy); only the forward compute and the activations it saves change precision,
which is where the memory goes at large image sizes. The model output is cast to float32 so
the MS-SSIM loss is always computed in float32.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from memstudy.techniques.tri_accel.control_units import Unit

LEVELS = ("fp16", "bf16", "fp32")  # tier order, low to high; the value stored is the index
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def assign_precision(variance: float, tau_low: float, tau_high: float, low: str = "fp16") -> str:
    """The paper's rule: low precision below tau_low, BF16 up to tau_high, FP32 from there.

    `low` is the lowest tier: "fp16" (GPU) or "bf16" (where FP16 is refused, e.g. the CPU)."""
    if variance < tau_low:
        return low
    if variance < tau_high:
        return "bf16"
    return "fp32"


class VarianceEMA:
    """v(t) = beta v(t-1) + (1 - beta) Var(t), started at the first observation (no zero bias)."""

    def __init__(self, beta: float):
        self.beta = beta
        self.value: torch.Tensor | None = None
        self.updates = 0

    def update(self, variance: torch.Tensor) -> None:
        variance = variance.detach().float()
        if self.value is None:
            self.value = variance.clone()
        else:  # stays on the device: no synchronisation until the control step reads it
            self.value.mul_(self.beta).add_(variance, alpha=1 - self.beta)
        self.updates += 1


class UnitPrecision:
    """Runs each unit's modules under the unit's current precision level."""

    def __init__(self, units: list[Unit], device_type: str, initial: str):
        self.device_type = device_type
        self.levels = {u.name: initial for u in units}
        self._forced: str | None = None
        for unit in units:
            for module in unit.modules:
                self._wrap(module, unit.name)

    def level(self, unit: str) -> str:
        return self._forced or self.levels[unit]

    @contextlib.contextmanager
    def forced(self, level: str) -> Iterator[None]:
        """Every unit at `level` for a while (the curvature estimate runs in float32)."""
        self._forced = level
        try:
            yield
        finally:
            self._forced = None

    def uses(self, level: str) -> bool:
        return level in self.levels.values()

    def _wrap(self, module: nn.Module, unit: str) -> None:
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            level = self.level(unit)
            if level == "fp32":  # inputs may arrive in 16 bit from a lower-precision unit
                args = tuple(_to_fp32(a) for a in args)
                kwargs = {k: _to_fp32(v) for k, v in kwargs.items()}
                with torch.autocast(self.device_type, enabled=False):
                    return inner(*args, **kwargs)
            with torch.autocast(self.device_type, dtype=DTYPES[level]):
                return inner(*args, **kwargs)

        module.forward = forward  # instance attribute: state_dict and module names unchanged


def float_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: the model's output in float32, so the loss is computed in float32."""
    return output.float()


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value
