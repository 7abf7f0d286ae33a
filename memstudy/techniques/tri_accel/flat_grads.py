"""Gradients as views into one flat buffer, so Tri-Accel's per-unit statistics read them in place.

Why: the fused statistics kernel (grad_stats.py, beside this file) needs every unit's gradients
end to end in one buffer. Gathering them with `torch.cat` each step copied all 24.4 M gradient
elements (98 MB) and made the fused path slower end to end than a loop of reductions (H200:
0.59 ms vs 0.46 ms; the kernel alone 0.09 ms). Here every parameter's `.grad` *is* a view into
one float32 buffer, laid out unit after unit, parameter after parameter (the way DDP's
`gradient_as_bucket_view` lays gradients into its buckets): autograd accumulates into the
views in place, and the kernel reads the buffer with no copy.

Each view has its parameter's strides (`torch.as_strided`: channels_last weights get
channels_last gradients), over exactly the parameter's own elements of the buffer, so the
optimizer sees gradients of the usual layout; statistics do not depend on the order of the
elements inside a unit.

Lifetime and memory: the buffer is allocated once and kept (gradients stay allocated between
steps, as under DDP's bucket views). The training step's `zero_grad(set_to_none=True)` drops
the views; `attach` (called before each backward) re-attaches them and zeroes the buffer at the
first backward of the next step. Costs against PyTorch's own gradients: the gradient bytes are
alive during the forward too (+4 bytes per parameter in the forward's peak: 98 MB for the
U-Net), one memset of the buffer per step, and autograd adds each first gradient into zeros
instead of adopting it. benchmarks/bench_triaccel.py measures the net effect.
"""
from __future__ import annotations

import torch
from torch import nn

from memstudy.errors import ConfigError


class FlatGradients:
    def __init__(self, groups: list[list[nn.Parameter]], device: torch.device):
        params = [p for group in groups for p in group]
        odd = sorted({str(p.dtype) for p in params} - {str(torch.float32)})
        if odd:  # one float32 buffer: other gradient dtypes would need a buffer each
            raise ConfigError(f"tri_accel:grad_layout=flat needs float32 parameters (found {odd}); "
                              "use tri_accel:grad_layout=separate")
        self.sizes = [sum(p.numel() for p in group) for group in groups]  # one segment per unit
        self.buffer = torch.zeros(sum(self.sizes), dtype=torch.float32, device=device)
        self.views: list[tuple[nn.Parameter, torch.Tensor]] = []
        pos = 0
        for p in params:
            if not _dense(p):
                raise ConfigError("tri_accel:grad_layout=flat needs dense parameters (a "
                                  "non-overlapping stride layout); use grad_layout=separate")
            self.views.append((p, torch.as_strided(self.buffer, p.shape, p.stride(), pos)))
            pos += p.numel()

    def attach(self) -> None:
        """Before a backward: if the step's gradients were dropped (zero_grad(set_to_none)),
        zero the buffer and make every `.grad` its view again; else leave them (later
        micro-batches of an accumulated step add to the same views)."""
        if all(p.grad is view for p, view in self.views):
            return
        if any(p.grad is not None and p.grad is not view for p, view in self.views):
            raise RuntimeError("tri_accel flat gradients: a .grad was replaced by another tensor "
                               "between backwards; its values would be lost")
        self.buffer.zero_()
        for p, view in self.views:
            p.grad = view

    def attached(self) -> bool:
        return all(p.grad is view for p, view in self.views)


def _dense(p: torch.Tensor) -> bool:
    """Strides that cover exactly numel() elements without overlap (any permutation of dims)."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(p.shape, p.stride()) if size > 1)
    return p.numel() == 0 or (extent == p.numel() and all(s >= 0 for s in p.stride())
                              and _non_overlapping(p))


def _non_overlapping(p: torch.Tensor) -> bool:
    dims = sorted((stride, size) for size, stride in zip(p.shape, p.stride()) if size > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True
