"""Top-k Hessian eigenvalues per unit by power iteration on Hessian-vector products.

One forward and one backward with create_graph=True give every gradient as a differentiable
function; each unit's block of the Hessian, H_ll, is then applied to a vector v_l by one more
`torch.autograd.grad(g_l, params_l, v_l)`. Power iteration converges to the eigenvalue of
largest magnitude; for k > 1 each found pair is removed by Hotelling deflation,
H' = H - sum_j lambda_j u_j u_j^T. Cost per unit: `iters * k` products, each about one
backward of the double-backward graph; the graph itself costs about twice a training step's
activation memory, which is why the curvature batch is small and may be a crop.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

Vec = list[torch.Tensor]


def _dot(a: Vec, b: Vec) -> torch.Tensor:
    return sum((x * y).sum() for x, y in zip(a, b))


def _normalised(v: Vec) -> Vec:
    norm = torch.sqrt(_dot(v, v))
    return [x / norm for x in v]


def power_iteration(hvp: Callable[[Vec], Sequence[torch.Tensor]], like: Sequence[torch.Tensor],
                    k: int = 1, iters: int = 20, tol: float = 1e-4,
                    generator: torch.Generator | None = None) -> list[float]:
    """The k eigenvalues of largest magnitude of the operator `hvp` acting on tensors shaped
    like `like`, each by at most `iters` power steps (stopping early at relative change < tol)."""
    found: list[tuple[float, Vec]] = []
    for _ in range(k):
        v = _normalised([torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.device)
                         for p in like])
        lam = 0.0
        for _ in range(iters):
            hv = [h.detach().float() for h in hvp(v)]
            for lam_j, u in found:  # deflation: remove what is already found
                c = lam_j * _dot(u, v)
                hv = [h - c * x for h, x in zip(hv, u)]
            new = float(_dot(v, hv))  # Rayleigh quotient (v has unit norm)
            norm = float(torch.sqrt(_dot(hv, hv)))
            if norm == 0.0:
                lam = new
                break
            v = [h / norm for h in hv]
            converged = abs(new - lam) <= tol * abs(new)
            lam = new
            if converged:
                break
        found.append((lam, v))
    return [lam for lam, _ in found]


def unit_eigenvalues(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor,
                     units: dict[str, list[nn.Parameter]], k: int, iters: int,
                     generator: torch.Generator | None = None) -> dict[str, list[float]]:
    """Top-k eigenvalues of each unit's Hessian block for the loss on (x, y).

    BatchNorm running statistics are restored afterwards: the estimate must not train."""
    buffers = [b.detach().clone() for b in model.buffers()]
    try:
        loss = loss_fn(model(x), y)
        params = [p for ps in units.values() for p in ps]
        grads = torch.autograd.grad(loss, params, create_graph=True)
        out, pos = {}, 0
        for name, ps in units.items():
            g = grads[pos:pos + len(ps)]
            pos += len(ps)

            def hvp(v: Vec, g=g, ps=ps) -> Sequence[torch.Tensor]:
                return torch.autograd.grad(g, ps, grad_outputs=v, retain_graph=True)

            out[name] = power_iteration(hvp, ps, k=k, iters=iters, generator=generator)
        return out
    finally:
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers):
                b.copy_(saved)
