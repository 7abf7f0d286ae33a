"""AB training ([Coquelin] (docs/references.md) Algorithm 2) on the data-parallel ranks: the schedule and the factors.

Cycle, with the step hook acting after optimizer step t:
- full-rank DP for `warmup` steps (DDP as usual);
- AB phase (`ab_steps` steps): every eligible weight W becomes A B with A = U_k Sigma_k^1/2,
  B = Sigma_k^1/2 V_k^T (eq. 5.3), k the singular values above sigma_cutoff * the largest
  (eq. 5.4). Ranks < world/2 (the A group) train A with B frozen, the others train B with A
  frozen; DDP's gradient all-reduce is switched off (`no_sync`) and each group averages its
  gradients inside the group only (independent subgroup training);
- synchronisation: A and B are averaged over all ranks (eq. 5.8: mean(A) mean(B)), every other
  parameter (biases, BatchNorm, layers kept full rank) too, and W <- A B is written back into
  the original full-rank parameter (the one DDP holds);
- full-rank DP rebound for `rebound` steps, then the next AB phase.
Optimizer state of a weight is reset whenever its representation changes shape (section 5.2);
the dissertation's learning-rate rebound after a reset is not implemented (the LR stays at its
scheduled value).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from memstudy.lowrank.factors import as_matrix, eligible_layers, kept_rank, svd


class ABWeight:
    """W of `module` as A @ B (parameters `ab_a`, `ab_b`); the full Parameter is kept aside."""

    def __init__(self, name: str, module: nn.Module, cutoff: float, train_a: bool):
        self.name, self.module, self.full = name, module, module.weight
        self.shape = tuple(self.full.shape)
        u, s, vt = svd(as_matrix(self.full))
        k = kept_rank(s, cutoff)
        root = s[:k].sqrt()
        dtype = self.full.dtype
        del module.weight
        module.ab_a = nn.Parameter((u[:, :k] * root).to(dtype), requires_grad=train_a)
        module.ab_b = nn.Parameter((root[:, None] * vt[:k]).to(dtype), requires_grad=not train_a)
        self.rank = k
        self._hook = module.register_forward_pre_hook(lambda m, args: self._rebuild())
        self._rebuild()

    @property
    def trained(self) -> nn.Parameter:
        return self.module.ab_a if self.module.ab_a.requires_grad else self.module.ab_b

    def product(self) -> torch.Tensor:
        with torch.autocast(self.module.ab_a.device.type, enabled=False):
            return (self.module.ab_a @ self.module.ab_b).reshape(self.shape)

    def _rebuild(self) -> None:
        self.module.weight = self.product()

    @torch.no_grad()
    def restore(self) -> nn.Parameter:
        """W <- A B into the original Parameter, which becomes the module's weight again."""
        self.full.copy_(self.product())
        self._hook.remove()
        m = self.module
        del m.weight, m.ab_a, m.ab_b
        m.weight = self.full
        return self.full


class ABSchedule:
    def __init__(self, model: nn.Module, ddp: nn.Module | None, warmup: int, ab_steps: int,
                 rebound: int, cutoff: float, skip_first: bool, skip_last: bool,
                 rank: int, world: int, total: int | None = None):
        self.model, self.ddp = model, ddp
        self.warmup, self.ab_steps, self.rebound, self.cutoff = warmup, ab_steps, rebound, cutoff
        self.layers = eligible_layers(model, skip_first, skip_last)
        self.rank, self.world, self.total = rank, world, total
        self.train_a = rank < world // 2  # Algorithm 2 lines 1-4
        half = world // 2
        groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world)))]
        self.group = groups[0] if self.train_a else groups[1]
        self.group_size = half if self.train_a else world - half
        self.factors: list[ABWeight] = []
        self.rows: list[tuple[int, int, str, float]] = []
        self._step_bytes = 0
        self._sync_ctx = None

    # -- phases ------------------------------------------------------------------------------
    def in_ab(self) -> bool:
        return bool(self.factors)

    def ab_starts_after(self, t: int) -> bool:
        period = self.ab_steps + self.rebound
        return t >= self.warmup and (t - self.warmup) % period == 0

    def ab_ends_after(self, t: int) -> bool:
        period = self.ab_steps + self.rebound
        return t > self.warmup and (t - self.warmup) % period == self.ab_steps

    # -- hooks -------------------------------------------------------------------------------
    def forward_context(self):
        """DDP's gradient all-reduce is off while the groups train independently."""
        import contextlib
        if self.in_ab() and self.ddp is not None:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    @torch.no_grad()
    def before_step(self, optimizer) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        if self.in_ab():  # independent subgroup training: average inside the group only
            flat = _flatten_dense_tensors([p.grad for p in params])
            dist.all_reduce(flat, group=self.group)
            flat /= self.group_size
            for p, g in zip(params, _unflatten_dense_tensors(flat, [p.grad for p in params])):
                p.grad.copy_(g)
            self._step_bytes += flat.nbytes
        else:  # DDP all-reduced every gradient in backward
            self._step_bytes += sum(p.grad.nbytes for p in params)

    @torch.no_grad()
    def after_step(self, t: int, optimizer) -> None:
        if self.in_ab() and (self.ab_ends_after(t) or t == self.total):  # the run ends in sync
            self._step_bytes += self.synchronise(optimizer)
            self.rows.append((self.rank, t, "ab_sync", 1.0))
        elif not self.in_ab() and self.ab_starts_after(t):
            self.decompose(optimizer)
            self.rows.append((self.rank, t, "ab_rank_sum", float(sum(f.rank for f in self.factors))))
        self.rows.append((self.rank, t, "ab_comm_bytes", float(self._step_bytes)))
        self._step_bytes = 0

    def decompose(self, optimizer) -> None:
        for name, module in self.layers:
            f = ABWeight(name, module, self.cutoff, self.train_a)
            self.factors.append(f)
            _swap(optimizer, f.full, f.trained)

    def synchronise(self, optimizer) -> int:
        """A <- mean A, B <- mean B over all ranks (Algorithm 2 lines 15-16), the other
        parameters too; then W <- A B (line 18). Returns the payload bytes all-reduced."""
        tensors = [t for f in self.factors for t in (f.module.ab_a, f.module.ab_b)]
        ids = {id(t) for t in tensors}
        tensors += [p for p in self.model.parameters() if id(p) not in ids]
        flat = _flatten_dense_tensors([t.detach() for t in tensors])
        dist.all_reduce(flat)
        flat /= self.world
        for t, avg in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.copy_(avg)
        for f in self.factors:
            trained = f.trained
            _swap(optimizer, trained, f.restore())
        self.factors = []
        return flat.nbytes

    def series(self) -> list[tuple[int, int, str, float]]:
        return list(self.rows)


def _swap(optimizer, old: nn.Parameter, new: nn.Parameter) -> None:
    """`new` takes `old`'s place in its parameter group with a fresh (empty) state."""
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if p is old:
                group["params"][i] = new
                optimizer.state.pop(old, None)
                optimizer.state.pop(new, None)
                return
    raise RuntimeError("ab: a decomposed weight is not in the optimizer")
