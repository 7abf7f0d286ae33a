"""Gradient accumulation ([Compute-Opt] (docs/references.md) section III.B): `accumulate:4`, or adaptive k.

Memory / compute trade-off: an optimizer step sums the gradients of k micro-batches of
train.batch_size images (each loss scaled by 1/k, eq. 4) and then steps once (eq. 5), so the
effective batch is k x batch_size while the activations alive at any moment are those of one
micro-batch (eq. 8: M = M_model + M_optimizer + M_activation / k, against the k-times larger
batch). Parameters, gradients and optimizer state are unchanged; gradients stay allocated
across the k backwards. Cost: k smaller forwards and backwards instead of one large one, which
use the GPU less well (time per image rises as the micro-batch shrinks), and one optimizer
step per k micro-batches (time per image falls with k against stepping every micro-batch).
`memstudy.report.accumulation` finds the k that maximises throughput / memory among measured
runs of one effective batch (eq. 9).

BatchNorm: each micro-batch's forward normalises with its *own* batch statistics and updates
the running statistics once (k updates per optimizer step, with momentum 0.1 each), so on a
network with BatchNorm (the U-Net) accumulation is not the k-times larger batch: the gradient
equals it only where BatchNorm does not act per batch (eval-mode BN, or a BN-free network;
tests/test_tech_accumulate.py checks that through the training loop).

Adaptive k (`mode=adaptive`, eq. 6-7): after every step of k >= 2 equal micro-batches the
gradient variance sigma^2 = 1/(k-1) sum_j ||g_j - g_acc||^2 is measured (g_j: micro-batch
j's gradient, g_acc their mean) and the next step takes k = min(k_max, ceil(sigma^2 /
(sigma_target^2 + eps))), but at least 2: eq. 7 needs two micro-batches, and k = 1 would stop
the estimate for good. ||g_j||^2 comes from a hook on every parameter (the gradient of that
backward alone, before it is added to .grad), ||g_acc||^2 from .grad after the last micro-batch,
so no gradient copy is kept: sigma^2 = (k^2 sum_j ||h_j||^2 - k ||G||^2) / (s^2 (k-1)) with h_j
the hooked gradients of the loss scaled by 1/k and the loss scale s, G = .grad. Cost: one
squared norm per parameter tensor per micro-batch and one per step. docs/techniques/accumulate.md.
"""
from __future__ import annotations

import math
import torch

from memstudy.errors import ConfigError
from memstudy.runtime import MicroBatch, StepInfo
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import DEFAULT_K_MAX
from memstudy.techniques.options import AccumulateOptions as Options

EPS = 1e-12  # eq. 6's epsilon: keeps the ratio finite for sigma_target -> 0


def check(opts: Options, plan: Plan) -> None:
    if opts.k < 1:
        raise ConfigError(f"accumulate:k must be >= 1 (got {opts.k})")
    if opts.k_max < 1:
        raise ConfigError(f"accumulate:k_max must be >= 1 (got {opts.k_max})")
    if opts.sigma_target is not None and not opts.sigma_target > 0:
        raise ConfigError(f"accumulate:sigma_target must be > 0 (got {opts.sigma_target})")
    if opts.mode == "fixed":
        _check_fixed(opts)
    else:
        _check_adaptive(opts, plan)
    if plan.has("pipeline"):
        raise ConfigError("accumulate with pipeline: the pipeline schedule already splits each "
                          "batch into micro-batches; use pipeline:micro_batches=... instead")


def _check_fixed(opts: Options) -> None:
    if opts.sigma_target is not None or opts.k_max != DEFAULT_K_MAX:
        raise ConfigError("accumulate: k_max and sigma_target apply only to mode=adaptive; "
                          "drop them or set accumulate:mode=adaptive")


def _check_adaptive(opts: Options, plan: Plan) -> None:
    if opts.sigma_target is None:
        raise ConfigError("accumulate:mode=adaptive needs accumulate:sigma_target=<value > 0> "
                          "(eq. 6's target; no default could suit every loss scale)")
    if opts.k_max < 2 or not 2 <= opts.k <= opts.k_max:
        raise ConfigError(f"accumulate:mode=adaptive needs 2 <= k <= k_max (got k={opts.k}, "
                          f"k_max={opts.k_max}): eq. 7 estimates the variance from >= 2 "
                          "micro-batches")
    from memstudy.techniques import get_technique

    for name in plan.chosen:
        if get_technique(name).stage == Stage.PARALLEL:
            raise ConfigError(f"accumulate:mode=adaptive with {name}: each rank would measure "
                              "only its own gradient variance and choose its own k; use "
                              "mode=fixed with data-parallel techniques")


def adaptive_k(sigma2: float, sigma_target: float, k_max: int) -> int:
    """Eq. 6: min(k_max, ceil(sigma^2 / (sigma_target^2 + eps)))."""
    return min(k_max, math.ceil(sigma2 / (sigma_target ** 2 + EPS)))


def gradient_variance(norms_sq: list[float], mean_norm_sq: float) -> float:
    """Eq. 7 from squared norms: 1/(k-1) sum_j ||g_j - g||^2 = (sum_j ||g_j||^2 - k ||g||^2) /
    (k - 1), g the mean of the k gradients g_j (the identity needs no copy of any g_j)."""
    k = len(norms_sq)
    if k < 2:
        raise ValueError("the gradient variance needs at least two micro-batches")
    return max(0.0, (sum(norms_sq) - k * mean_norm_sq) / (k - 1))


class AdaptiveAccumulation:
    """Measures sigma^2 over each step's micro-batches and sets the next step's k (eq. 6-7)."""

    def __init__(self, opts: Options, build: Build):
        self.opts, self.rt, self.device = opts, build.runtime, build.device
        self.params = [p for p in build.model.parameters() if p.requires_grad]
        self._sq = torch.zeros((), dtype=torch.float64, device=build.device)  # this backward's
        self._norms_sq: list[torch.Tensor] = []  # sum ||h||^2 of each micro-batch of the step
        self._sizes: list[int] = []  # images of each micro-batch of the step
        self.rows: list[tuple[int, str, float]] = []
        for p in self.params:
            p.register_hook(self._observe)
        # every training forward starts a new sum: gradients taken outside the loop's backward
        # (tri_accel's curvature estimate) are not counted
        build.model.register_forward_pre_hook(self._restart)
        self.rt.micro_batch_hooks.append(self.on_micro_batch)
        self.rt.step_hooks.append(self.on_step)
        self.rt.series_sources.append(self.series)
        self._pending: tuple[int, torch.Tensor] | None = None

    def _restart(self, module: torch.nn.Module, args) -> None:
        if module.training and torch.is_grad_enabled():
            self._sq.zero_()

    def _observe(self, grad: torch.Tensor) -> None:
        # the gradient of this backward alone (autograd calls tensor hooks before accumulating)
        self._sq += grad.detach().float().square().sum().to(self.device)

    def on_micro_batch(self, micro: MicroBatch) -> None:
        if micro.index == 0:  # a new step (or a step retried after an OOM): start over
            self._norms_sq, self._sizes = [], []
        self._norms_sq.append(self._sq.clone())
        self._sizes.append(micro.images)
        self._pending = None
        # eq. 7 assumes k micro-batches of one size: the epoch's short last step is left out
        if micro.index == micro.count - 1 and micro.count >= 2 and len(set(self._sizes)) == 1:
            self._pending = (micro.step, self._variance(micro.count))

    def _variance(self, k: int) -> torch.Tensor:
        """sigma^2 on the device (no sync): hooked gradients are of loss/k, times the loss scale."""
        grads = [p.grad for p in self.params if p.grad is not None]
        total_sq = sum(g.float().square().sum().double().to(self.device) for g in grads)
        sigma2 = (k * k * torch.stack(self._norms_sq).sum() - k * total_sq) / (k - 1)
        return sigma2.clamp_min(0) / self._loss_scale() ** 2

    def _loss_scale(self) -> torch.Tensor | float:
        scaler = self.rt.scaler
        return scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0

    def on_step(self, info: StepInfo) -> None:
        """After the step: read sigma^2 (one host sync per step) and choose the next k."""
        if self._pending is None or self._pending[0] != info.step:
            return
        sigma2 = float(self._pending[1])
        self._pending = None
        if not math.isfinite(sigma2):  # an fp16 overflow step (skipped by the scaler)
            return
        self.rt.micro_batches = max(2, adaptive_k(sigma2, self.opts.sigma_target, self.opts.k_max))
        self.rows += [(info.step, "accum_sigma2", sigma2),
                      (info.step, "accum_k_next", float(self.rt.micro_batches))]

    def series(self) -> list[tuple[int, int, str, float]]:
        return [(self.rt.rank, step, name, value) for step, name, value in self.rows]


def apply(opts: Options, build: Build) -> None:
    build.runtime.micro_batches = opts.k
    build.notes["accumulate"] = {"k": opts.k, "mode": opts.mode}
    if opts.mode == "adaptive":
        AdaptiveAccumulation(opts, build)


register(Technique("accumulate", Stage.RUNTIME, Options,
                   "k micro-batches per optimizer step (activations of one micro-batch, "
                   "effective batch k x batch_size); adaptive k from the gradient variance",
                   apply, check, micro_batches=lambda o: o.k,
                   most_micro_batches=lambda o: o.k_max if o.mode == "adaptive" else o.k))
