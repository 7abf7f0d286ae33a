"""A Conv2d / Linear weight held as factors, rebuilt before every forward of its module.

The weight of shape (out, in, kh, kw) is viewed as the 2-D matrix out x (in * kh * kw) ([Coquelin] (docs/references.md)
section 4.3; a Linear weight is already 2-D). `LowRankWeight` removes the module's `weight`
parameter and registers the factors on the module instead (so `model.parameters()`, `.to()`
and `state_dict()` see them); a forward pre-hook sets `module.weight` to the product, which
autograd differentiates back to whichever factors require grad.

Why rebuild rather than run two thinner convolutions: the product is exact for any rank, so
the conversion can be checked against the full weight, and it adds no activation of its own
besides the rebuilt weight (one weight-sized tensor per layer, freed after backward).
"""
from __future__ import annotations

import torch
from torch import nn

ELIGIBLE = (nn.Conv2d, nn.Linear)


def as_matrix(weight: torch.Tensor) -> torch.Tensor:
    """(out, in, kh, kw) -> (out, in*kh*kw); 2-D weights unchanged (a view, no copy)."""
    return weight.reshape(weight.shape[0], -1)


def svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compact SVD in float64 (the factors are cast back by the caller): U (m x r), s (r), Vt (r x n)."""
    u, s, vt = torch.linalg.svd(matrix.detach().to(torch.float64), full_matrices=False)
    return u, s, vt


def kept_rank(singular_values: torch.Tensor, beta: float) -> int:
    """How many singular values (sorted, descending) are >= beta * the largest (at least one)."""
    if singular_values.numel() == 0:
        return 0
    return max(1, int((singular_values >= beta * singular_values[0]).sum().item()))


def base_update(u: torch.Tensor, sigma: torch.Tensor, vt: torch.Tensor, beta: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[Coquelin] eq. 4.13 with the beta cut-off of Algorithm 1 (lines 9-11):

        U', Sigma', V'^T <- SVD(Sigma);  U <- U U';  V^T <- V'^T V^T;  Sigma <- Sigma'
    then singular values below beta * max(Sigma') are dropped with their basis vectors.
    Computed in float64; returns (U, Sigma, V^T) in the dtype of `sigma`, Sigma diagonal k x k.
    """
    u2, s2, vt2 = svd(sigma)
    k = kept_rank(s2, beta)
    new_u = u.to(torch.float64) @ u2[:, :k]
    new_vt = vt2[:k] @ vt.to(torch.float64)
    dtype = sigma.dtype
    return new_u.to(dtype), torch.diag(s2[:k]).to(dtype), new_vt.to(dtype)


class LowRankWeight:
    """The weight of `module` as U @ Sigma @ V^T; only Sigma (r x r) is a parameter.

    U (m x r) and V^T (r x n) are buffers `lowrank_u` / `lowrank_vt`, Sigma the parameter
    `lowrank_s`. `reshape(u, sigma, vt)` changes the rank in place, keeping the Sigma
    Parameter object (the optimizer holds it) and swapping its data.
    """

    def __init__(self, name: str, module: nn.Module):
        self.name, self.module = name, module
        weight = module.weight
        self.shape = tuple(weight.shape)
        self.full_numel = weight.numel()
        u, s, vt = svd(as_matrix(weight))
        dtype = weight.dtype
        self.replaced = weight  # the full-rank Parameter (the caller drops it from the optimizer)
        del module.weight  # unregister: from now on `weight` is a plain tensor set by the hook
        module.register_buffer("lowrank_u", u.to(dtype))
        module.register_buffer("lowrank_vt", vt.to(dtype))
        module.register_parameter("lowrank_s", nn.Parameter(torch.diag(s).to(dtype)))
        self._hook = module.register_forward_pre_hook(self._rebuild)
        self.rebuild_weight()

    @property
    def sigma(self) -> nn.Parameter:
        return self.module.lowrank_s

    @property
    def rank(self) -> int:
        return self.sigma.shape[0]

    def product(self) -> torch.Tensor:
        m = self.module
        # The product in the factors' own dtype, outside autocast: the rounding of a float16
        # matmul would be a second, unmeasured approximation of the weight.
        with torch.autocast(m.lowrank_u.device.type, enabled=False):
            return (m.lowrank_u @ m.lowrank_s @ m.lowrank_vt).reshape(self.shape)

    def rebuild_weight(self) -> None:
        self.module.weight = self.product()

    def _rebuild(self, module: nn.Module, args) -> None:
        self.rebuild_weight()

    def reshape(self, u: torch.Tensor, sigma: torch.Tensor, vt: torch.Tensor) -> None:
        m = self.module
        m.lowrank_u = u.contiguous()
        m.lowrank_vt = vt.contiguous()
        m.lowrank_s.data = sigma.contiguous()
        m.lowrank_s.grad = None
        self.rebuild_weight()

    def stored_numel(self) -> int:
        """Elements held for this weight now: U, Sigma and V^T."""
        m = self.module
        return m.lowrank_u.numel() + m.lowrank_s.numel() + m.lowrank_vt.numel()


def eligible_layers(model: nn.Module, skip_first: bool, skip_last: bool) -> list[tuple[str, nn.Module]]:
    """Conv2d / Linear modules in definition order (input side first), optionally without the
    first (the 1-channel stem: a 64 x 49 matrix) and the last (the 1-output head: 1 x 144)."""
    layers = [(n, m) for n, m in model.named_modules()
              if isinstance(m, ELIGIBLE) and isinstance(getattr(m, "weight", None), nn.Parameter)]
    if skip_first and layers:
        layers = layers[1:]
    if skip_last and layers:
        layers = layers[:-1]
    return layers
