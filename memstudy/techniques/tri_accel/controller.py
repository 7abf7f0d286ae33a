"""The unified control loop: every t_ctrl steps, statistics -> precisions -> learning rates -> batch.

Installed by the `tri_accel` technique on a built pipeline. It owns:
- an optimizer with one parameter group per control unit (for per-unit learning rates) and a
  step pre-hook that feeds every unit's gradient variance (one fused kernel on a GPU) to an EMA;
- the per-unit precision wrappers (`UnitPrecision`);
- the curvature estimate every t_curv steps on a captured mini-batch of b_curv images;
- the elastic batch controller and the out-of-memory handler that shrinks and retries.
Every control step appends rows (step, name, value) that the runner stores in `series`.
"""
from __future__ import annotations

import contextlib
import math
import time
import traceback
from typing import Any

import torch

from memstudy.techniques.tri_accel.grad_stats import (flatten, make_layout, segment_stats,
                                                   segment_stats_reference)
from memstudy.runtime import StepInfo
from memstudy.techniques.tri_accel.curvature import unit_eigenvalues
from memstudy.techniques.tri_accel.elastic import CudaMemory, ElasticBatch, MeterMemory
from memstudy.techniques.tri_accel.flat_grads import FlatGradients
from memstudy.techniques.tri_accel.precision import (LEVELS, UnitPrecision, VarianceEMA,
                                                   assign_precision, float_output)
from memstudy.techniques.tri_accel.control_units import unet_units
from memstudy.tiling.validation import UNTILED_REASON


class TriAccelController:
    def __init__(self, opts: Any, build: Any):
        self.opts, self.rt, self.device = opts, build.runtime, build.device
        self.model = build.model
        self.units = unet_units(build.model)
        self.params = {u.name: u.parameters() for u in self.units}
        self.base_lr, self.base_batch = build.config.train.lr, build.config.train.batch_size
        self.rows: dict[tuple[int, str], float] = {}
        self.step, self.optimizer = 0, None
        self.eigen: dict[str, list[float]] = {}
        self.precision = self.ema = None
        if opts.precision:
            self.precision = UnitPrecision(self.units, self.device.type, initial="bf16")
            self.ema = VarianceEMA(opts.beta)
            build.model.register_forward_hook(float_output)
            self.rt.float32_contexts.append(lambda: self.precision.forced("fp32"))
            # the tiled validation walk calls the blocks' layers itself, past the unit wrappers
            setattr(build.model, UNTILED_REASON, "tri_accel:precision sets autocast per unit, "
                    "which the tiled walk would bypass")
            if opts.low == "fp16":  # FP16 units may appear at any control step: scale the loss
                self.rt.scaler = torch.amp.GradScaler(self.device.type)
        self._layout, self._curv_batch, self._capture = None, None, False
        self.flat = None
        if opts.precision and opts.grad_layout == "flat":
            self.flat = FlatGradients([self.params[u.name] for u in self.units], self.device)
            inner_backward = self.rt.backward

            def backward(loss: torch.Tensor) -> None:
                self.flat.attach()  # the step's first backward: views back, buffer zeroed
                inner_backward(loss)

            self.rt.backward = backward
        # curvature cost bound: training wall time since the first step, and the estimates' share
        self._started: float | None = None
        self.curv_spent, self._curv_last = 0.0, None
        if opts.curvature:
            build.model.register_forward_pre_hook(self._capture_input)
            self.rt.loss_fn = _CapturingLoss(self.rt.loss_fn, self)
        self.elastic = self.probe = None
        if opts.elastic:
            self.elastic = ElasticBatch(self.base_batch, opts.rho_low, opts.rho_high, opts.delta_up,
                                        opts.delta_down, opts.max_batch)
            budget = build.plan.budget_bytes  # parsed once (techniques.check_early)
            self.probe = (CudaMemory(self.device, budget) if self.device.type == "cuda"
                          else MeterMemory(lambda: self.rt.memory_meter, budget))
            self.rt.oom_handler = self.on_oom
        self._make_default_optimizer = self.rt.optimizer_factory
        self.rt.optimizer_factory = self.make_optimizer
        self.rt.step_hooks.append(self.on_step)
        self.rt.series_sources.append(self.series)

    # -- optimizer and statistics ---------------------------------------------------------------
    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The configured optimizer, rebuilt with one parameter group per unit (same settings)."""
        plain = self._make_default_optimizer(model)
        groups = [{"params": self.params[u.name], "unit": u.name} for u in self.units]
        self.optimizer = type(plain)(groups, **plain.defaults)
        if self.ema is not None:
            self.optimizer.register_step_pre_hook(self._collect_stats)
        return self.optimizer

    def _collect_stats(self, optimizer, args, kwargs) -> None:
        """Before each optimizer step (gradients unscaled): every unit's gradient variance."""
        if self.flat is not None and self.flat.attached():  # in place: no gathering copy
            sizes, flat = self.flat.sizes, self.flat.buffer
            self._update_ema(sizes, flat)
            return
        grads = [[p.grad for p in self.params[u.name] if p.grad is not None] for u in self.units]
        if any(not g for g in grads):
            return  # a unit without gradients this step: nothing comparable to average in
        sizes = [sum(g.numel() for g in unit) for unit in grads]
        self._update_ema(sizes, flatten([g for unit in grads for g in unit]))

    def _update_ema(self, sizes: list[int], flat: torch.Tensor) -> None:
        use_kernel = self.opts.stats == "triton" or (self.opts.stats == "auto" and flat.is_cuda)
        if use_kernel:
            if self._layout is None or self._layout[0] != sizes:  # built once: no per-step sync
                self._layout = (sizes, make_layout(sizes, flat.device))
            _, var = segment_stats(flat, self._layout[1])
        else:
            _, var = segment_stats_reference(flat, [0, *_cumsum(sizes)])
        self.ema.update(var)

    # -- curvature batch capture -------------------------------------------------------------------
    def _capture_input(self, module, args) -> None:
        if self._capture and module.training:
            self._curv_batch = (self._crop(args[0]), None)

    def capture_target(self, y: torch.Tensor) -> None:
        if self._capture and self._curv_batch is not None and self._curv_batch[1] is None:
            self._curv_batch = (self._curv_batch[0], self._crop(y))

    def _crop(self, t: torch.Tensor) -> torch.Tensor:
        t = t[: self.opts.b_curv]
        c = self.opts.curv_crop
        if c and c < t.shape[-1]:
            top, left = (t.shape[-2] - c) // 2, (t.shape[-1] - c) // 2
            t = t[..., top:top + c, left:left + c]
        return t.detach().clone()  # a copy: the training batch itself is not kept alive

    # -- the control loop --------------------------------------------------------------------------
    def on_step(self, info: StepInfo) -> None:
        self.step = info.step
        if self._started is None:  # the clock starts after the first step (its own time unknown)
            self._started = time.perf_counter()
        if info.step % self.opts.t_ctrl == 0:
            self.control(info.step)
        self._capture = self.opts.curvature and (info.step + 1) % self.opts.t_curv == 0

    def control(self, step: int) -> None:
        if self.opts.curvature and step % self.opts.t_curv == 0:
            if self._curvature_affordable():
                self._timed_curvature(step)
            else:
                self._curv_batch = None
                self._row(step, "curvature_skipped", 1.0)
            self._row(step, "curvature_share", self.curv_spent / self._elapsed())
        if self.precision is not None and self.ema.value is not None:
            self._set_precisions(step)
        if self.elastic is not None:
            used = self.probe.read()
            self.rt.batch_size = self.elastic.decide(used, self.probe.capacity)
            self._row(step, "mem_used_bytes", used)
            self._row(step, "mem_capacity_bytes", self.probe.capacity)
            self._row(step, "batch_next", self.rt.batch_size)
        self._set_learning_rates(step)

    def _elapsed(self) -> float:
        return max(time.perf_counter() - self._started, 1e-9)

    def _curvature_affordable(self) -> bool:
        return curvature_affordable(self.curv_spent, self._curv_last, self._elapsed(),
                                    self.opts.curv_budget)

    def _timed_curvature(self, step: int) -> None:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *a: None)
        sync(self.device)
        t0 = time.perf_counter()
        self._estimate_curvature(step)
        sync(self.device)
        self._curv_last = time.perf_counter() - t0
        self.curv_spent += self._curv_last
        self._row(step, "curvature_s", self._curv_last)

    def _estimate_curvature(self, step: int) -> None:
        if self._curv_batch is None or self._curv_batch[1] is None:
            return
        x, y = self._curv_batch
        self._curv_batch = None
        gen = torch.Generator().manual_seed(step)
        forced = self.precision.forced("fp32") if self.precision else contextlib.nullcontext()
        try:
            with forced:
                self.eigen = unit_eigenvalues(self.model, self.rt.loss_fn.inner, x, y,
                                              {n: ps for n, ps in self.params.items()},
                                              self.opts.top_k, self.opts.power_iters, gen)
        except torch.OutOfMemoryError:  # recorded; training goes on with the previous estimate
            self._row(step, "curvature_oom", 1.0)
            return
        for name, eigs in self.eigen.items():
            for i, lam in enumerate(eigs):
                self._row(step, f"eig{i + 1}/{name}", lam)
            self._row(step, f"lambda_max/{name}", max(eigs))

    def _set_precisions(self, step: int) -> None:
        o = self.opts
        for unit, var in zip(self.units, self.ema.value.tolist()):
            level = assign_precision(var, o.tau_low, o.tau_high, o.low)
            if self.eigen and max(self.eigen[unit.name]) > o.tau_curv:
                level = "fp32"  # promotion in steep regions, until the next curvature estimate
            self.precision.levels[unit.name] = level
            self._row(step, f"grad_var/{unit.name}", var)
            self._row(step, f"precision/{unit.name}", LEVELS.index(level))

    def batch_factor(self) -> float:
        """Learning-rate factor for the current batch: linear, square-root or no scaling."""
        ratio = self.rt.batch_size / self.base_batch
        return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[self.opts.lr_scaling]

    def _set_learning_rates(self, step: int | None) -> None:
        if self.optimizer is None:
            return
        factor = self.batch_factor() if self.elastic is not None else 1.0
        for group in self.optimizer.param_groups:
            lam = max(self.eigen.get(group["unit"], [0.0])) if self.opts.curvature else 0.0
            group["lr"] = self.base_lr * factor / (1 + self.opts.alpha * max(0.0, lam))
            if step is not None and (self.opts.curvature or self.elastic is not None):
                self._row(step, f"lr/{group['unit']}", group["lr"])

    def on_oom(self, exc: BaseException) -> bool:
        """Out of memory in a training step: shrink the batch and let the loop retry the step."""
        failed = self.rt.batch_size
        if not self.elastic.on_oom():
            return False
        # The failed attempt's activations are still referenced by the frames in the error's
        # traceback (a reference cycle only the garbage collector would break, later): free
        # them now, or the retry at the smaller batch runs out of memory too.
        traceback.clear_frames(exc.__traceback__)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.rt.batch_size = self.elastic.batch
        self.probe.read()  # forget the failed attempt's peak: the next window starts clean
        self._set_learning_rates(None)
        self._row(self.step + 1, "oom_at_batch", failed)
        return True

    # -- records -------------------------------------------------------------------------------------
    def _row(self, step: int, name: str, value: float) -> None:
        self.rows[(step, f"tri/{name}")] = float(value)  # one value per (step, name): the latest

    def series(self) -> list[tuple[int, int, str, float]]:
        return [(0, step, name, value) for (step, name), value in sorted(self.rows.items())]


class _CapturingLoss:
    """The runtime's loss, remembering the target of the curvature mini-batch when asked."""

    def __init__(self, inner, controller: TriAccelController):
        self.inner, self.controller = inner, controller

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.controller.capture_target(y)
        return self.inner(out, y)


def curvature_affordable(spent: float, last: float | None, elapsed: float, budget: float) -> bool:
    """Whether another curvature estimate, costing what the last one did, keeps the estimates'
    share of the training time within `budget`: (spent + last) / (elapsed + last) <= budget,
    `elapsed` the wall time since the first step (estimates included). The first always runs
    (its cost is unknown until measured), so the bound holds from the second estimate on."""
    if last is None:
        return True
    return spent + last <= budget * (elapsed + last)


def _cumsum(sizes: list[int]) -> list[int]:
    total, out = 0, []
    for n in sizes:
        total += n
        out.append(total)
    return out
