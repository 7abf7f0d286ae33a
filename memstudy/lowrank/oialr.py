"""OIALR, [Coquelin] (docs/references.md) Algorithm 1: full rank for d steps, then U Sigma V^T with only Sigma trained.

Schedule (t = optimizer steps taken; the controller is a step hook, so it acts after step t):
- t == d: every eligible weight becomes U Sigma V^T from its SVD at full rank (exact up to
  float rounding); the full weight leaves the optimizer (its Adam state is freed), Sigma joins
  it. d = 0 converts before the first step.
- t > d and t % nu == 0 (update u = 1, 2, ...): the last ceil(L * alpha * u) of the L weights
  (output side first; [Coquelin] fig. 4.2: layers near the input stabilise later) get the
  eq. 4.13 update, singular values below beta * max are dropped, and Sigma's optimizer state
  (Adam's exp_avg / exp_avg_sq, SGD's momentum buffer) is sliced to the kept k x k block.

Slicing the state is an approximation, as in the dissertation's "reshape ... optimizer states":
after eq. 4.13 Sigma is expressed in the rotated bases U U', V'^T V^T, while the state still
holds moments of the old Sigma's entries; the leading block is kept because the leading
singular directions change least.

Recorded per control step (step 1 as the full-rank reference, step d, every update) through
`runtime.series_sources`: trainable parameters, parameters held (trainable + the U / V
bases + frozen), optimizer-state bytes, the summed rank and every layer's rank.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from memstudy.lowrank.factors import LowRankWeight, base_update, eligible_layers
from memstudy.runtime import StepInfo


class OIALRController:
    def __init__(self, model: nn.Module, d: int, nu: int, alpha: float, beta: float,
                 skip_first: bool = True, skip_last: bool = True, rank: int = 0):
        self.model, self.d, self.nu, self.alpha, self.beta = model, d, nu, alpha, beta
        self.layers = eligible_layers(model, skip_first, skip_last)
        self.factors: list[LowRankWeight] = []
        self.updates = 0  # eq. 4.13 update events so far (u in ell = L * alpha * u)
        self.rows: list[tuple[int, int, str, float]] = []
        self.process_rank = rank
        if d == 0:
            self.convert(None)

    @property
    def converted(self) -> bool:
        return bool(self.factors)

    # -- Algorithm 1 -----------------------------------------------------------------------
    def on_step(self, info: StepInfo) -> None:
        t = info.step
        if t == self.d and not self.converted:
            self.convert(info.optimizer)
            self.record(t, info.optimizer)
        elif t == 1 and not self.converted:
            self.record(t, info.optimizer)  # full-rank reference figures
        elif self.converted and t > self.d and t % self.nu == 0:
            self.update(info.optimizer)
            self.record(t, info.optimizer)

    def convert(self, optimizer: torch.optim.Optimizer | None) -> None:
        for name, module in self.layers:
            lw = LowRankWeight(name, module)
            self.factors.append(lw)
            if optimizer is not None:
                _swap_param(optimizer, lw.replaced, lw.sigma)
            lw.replaced = None  # nothing holds the full weight any more: its memory is freed

    def layers_to_update(self) -> list[LowRankWeight]:
        """The last ceil(L * alpha * u) weights for update u (Algorithm 1, lines 8 and 12)."""
        count = min(len(self.factors), math.ceil(len(self.factors) * self.alpha * self.updates))
        return self.factors[len(self.factors) - count:]

    @torch.no_grad()
    def update(self, optimizer: torch.optim.Optimizer) -> None:
        self.updates += 1
        for lw in self.layers_to_update():
            m = lw.module
            u, sigma, vt = base_update(m.lowrank_u, m.lowrank_s.detach(), m.lowrank_vt, self.beta)
            k = sigma.shape[0]
            _slice_state(optimizer, lw.sigma, k)
            lw.reshape(u, sigma, vt)

    # -- records ---------------------------------------------------------------------------
    def figures(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        params = list(self.model.parameters())
        bases = sum(lw.module.lowrank_u.numel() + lw.module.lowrank_vt.numel() for lw in self.factors)
        out = {
            "lowrank_trainable_params": float(sum(p.numel() for p in params if p.requires_grad)),
            "lowrank_held_params": float(sum(p.numel() for p in params) + bases),
            "lowrank_optimizer_state_bytes": float(optimizer_state_bytes(optimizer)),
            "lowrank_rank_sum": float(sum(lw.rank for lw in self.factors)),
        }
        for lw in self.factors:
            out[f"lowrank_rank:{lw.name}"] = float(lw.rank)
        return out

    def record(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        self.rows.extend((self.process_rank, step, k, v) for k, v in self.figures(optimizer).items())

    def series(self) -> list[tuple[int, int, str, float]]:
        return list(self.rows)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.nbytes for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _swap_param(optimizer: torch.optim.Optimizer, old: nn.Parameter, new: nn.Parameter) -> None:
    """Replace `old` by `new` in its parameter group; old's state is dropped (freed)."""
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if p is old:
                group["params"][i] = new
                optimizer.state.pop(old, None)
                return
    raise RuntimeError("lowrank: a converted weight is not in the optimizer (was it frozen?)")


def _slice_state(optimizer: torch.optim.Optimizer, sigma: nn.Parameter, k: int) -> None:
    """Keep the leading k x k block of every Sigma-shaped state tensor (scalars such as Adam's
    step count stay)."""
    state = optimizer.state.get(sigma)
    if not state:
        return
    for key, value in list(state.items()):
        if torch.is_tensor(value) and value.shape == sigma.shape:
            state[key] = value[:k, :k].clone()
