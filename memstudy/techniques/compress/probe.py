"""What compression does to learning: per-step saved bytes before / after, and once, the
gradient's cosine and relative error against the same step re-run uncompressed (BatchNorm
statistics restored), at the last warm-up step so that no measured step pays for it.
"""
from __future__ import annotations

import torch
from torch import nn

from memstudy.techniques.compress.codec import Compressor
from memstudy.runtime import Runtime, StepInfo


class CompressionRecord:
    """Wraps the runtime's forward / backward: per-step saved bytes, and one gradient probe."""

    def __init__(self, compressor: Compressor, runtime: Runtime, probe_after: int | None):
        self.compressor, self.runtime = compressor, runtime
        self.probe_after = probe_after  # optimizer steps taken before the probed one (None: off)
        self.steps_done = 0
        self.rows: dict[tuple[int, str], float] = {}
        self._forward, self._backward = runtime.forward, runtime.backward
        self._pending: tuple | None = None
        runtime.forward, runtime.backward = self.forward, self.backward
        runtime.step_hooks.append(self._count_step)
        runtime.series_sources.append(self.series)

    def _count_step(self, info: StepInfo) -> None:
        self.steps_done = info.step

    def forward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        probe = self.probe_after == self.steps_done and self._pending is None
        if probe:
            self.probe_after = None  # once, on the first forward of that step
            self._pending = (model, x, y, _buffers(model), _grads(model))
        self.compressor.reset_tally()
        loss = self._forward(model, x, y)
        before, after = self.compressor.tally()
        step = self.steps_done + 1
        for name, value in (("compress_saved_before_bytes", before),
                            ("compress_saved_after_bytes", after)):
            self.rows[(step, name)] = self.rows.get((step, name), 0.0) + value
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        self._backward(loss)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            cosine, rel_error = self._probe(*pending)
            self.rows[(self.steps_done + 1, "compress_grad_cosine")] = cosine
            self.rows[(self.steps_done + 1, "compress_grad_rel_error")] = rel_error

    def _probe(self, model, x, y, buffers_before, grads_before) -> tuple[float, float]:
        """The same micro-batch again without compression: gradient deviation of the real one."""
        params = [p for p in model.parameters() if p.requires_grad]
        grads_after = [p.grad for p in params]
        buffers_after = _buffers(model)
        _restore(model, buffers_before)  # the reference forward starts from the same statistics
        for p in params:
            p.grad = None
        with self.compressor.paused():
            self._backward(self._forward(model, x, y))
        reference = [p.grad for p in params]
        _restore(model, buffers_after)  # as if only the compressed step had run
        for p, g in zip(params, grads_after):
            p.grad = g
        compressed = [None if a is None else a if b is None else a - b
                      for a, b in zip(grads_after, grads_before)]
        return gradient_deviation(compressed, reference)

    def series(self) -> list[tuple[int, int, str, float]]:
        rank = self.runtime.rank
        return [(rank, step, name, float(v)) for (step, name), v in sorted(self.rows.items())]


def gradient_deviation(grads: list, reference: list) -> tuple[float, float]:
    """(cosine similarity, |g - g_ref| / |g_ref|) over all parameters together, in float64."""
    dot = norm = ref_norm = diff = 0.0
    for g, r in zip(grads, reference):
        if g is None or r is None:
            continue
        g64, r64 = g.detach().double(), r.detach().double()
        dot += float((g64 * r64).sum())
        norm += float(g64.square().sum())
        ref_norm += float(r64.square().sum())
        diff += float((g64 - r64).square().sum())
    cosine = dot / (norm ** 0.5 * ref_norm ** 0.5) if norm and ref_norm else float("nan")
    return cosine, (diff ** 0.5 / ref_norm ** 0.5 if ref_norm else float("nan"))


def _buffers(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b, b.detach().clone()) for b in model.buffers()]


def _restore(model: nn.Module, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buf, value in saved:
            buf.copy_(value)


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone()
            for p in model.parameters() if p.requires_grad]
