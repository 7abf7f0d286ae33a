"""daso: distributed asynchronous and selective optimisation ([Coquelin] (docs/references.md) chapter 3).

Ranks form nodes of `node_size` consecutive ranks. Every step the gradients are averaged
inside the node only (node-local all-reduce). Every B steps of the cycling phase one rank per
node (the members of global group j: local index j of every node, j rotating) starts a
non-blocking all-reduce of its parameters, sent in `wire` precision (bf16 as in the
dissertation); S steps later the result is merged with the then-current local parameters by
eq. 3.2, w = (2S w_local + sum_i w_sent^i) / (2S + P) (P nodes), and broadcast inside each
node. Warm-up and cool-down steps synchronise globally and blockingly (gradients averaged over
all ranks, as dp; at the start of cool-down the parameters are averaged over all ranks).

Memory / compute trade-off: the same replica per rank as dp (parameters, gradients, optimizer
state), plus one flat parameter buffer per pending global send (one parameter copy in `wire`
precision, on the sending ranks) and a flat gradient buffer while averaging. What it buys is
communication: inter-node traffic is the parameters once every B steps from one rank per node
instead of the gradients every step from every rank, overlapped with S steps of training.

Why not heat's ht.optim.DASO: it communicates through heat's MPI communicator (mpi4py), needs
heat's data loaders and process layout, and steps the optimizer itself, so it fits neither
memstudy's launcher (torch.distributed process groups, one per run) nor its phase meters (the
optimizer step must stay memstudy's measured `step` phase). docs/techniques/daso.md says more.

Recorded per step (run `series`): `daso_grad_bytes` / `daso_param_bytes` (payload bytes this
rank put into collectives), `daso_send` (the global group j that started a send),
`daso_receive` (steps the merged parameters waited), `daso_blocking` (a blocking global
parameter average).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from memstudy.distributed import context
from memstudy.errors import ConfigError
from memstudy.techniques import planned_steps, register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import DasoOptions as Options

WIRE = {"bf16": torch.bfloat16, "fp32": torch.float32}


def node_size(opts: Options, world: int) -> int:
    return opts.node_size or context.local_world_size(world)


def check(opts: Options, plan: Plan) -> None:
    for name in ("B", "S"):
        if getattr(opts, name) < 1:
            raise ConfigError(f"daso:{name} must be >= 1 (got {getattr(opts, name)})")
    if opts.S > opts.B:
        raise ConfigError(f"daso:S={opts.S} must be <= daso:B={opts.B}: a global send must be "
                          "merged before the next one starts")
    for name in ("warmup", "cooldown", "node_size"):
        if getattr(opts, name) < 0:
            raise ConfigError(f"daso:{name} must be >= 0 (got {getattr(opts, name)})")
    context.check_world(plan, "daso")
    ws, n = plan.config.world_size, node_size(opts, plan.config.world_size)
    if ws % n or ws // n < 2:
        raise ConfigError(f"daso needs at least 2 nodes of daso:node_size ranks: world_size {ws} "
                          f"with node_size {n} gives {ws / n:g}; set daso:node_size to a divisor "
                          f"of world_size up to {ws // 2} (on one host it emulates nodes)")
    steps = planned_steps(plan.config, plan.config.data.train_images, chosen=plan.chosen)
    if opts.warmup + opts.cooldown >= steps:
        raise ConfigError(f"daso:warmup={opts.warmup} + daso:cooldown={opts.cooldown} leave no "
                          f"cycling step of the run's {steps}; lower them")
    amp = plan.chosen.get("amp")
    if amp is not None and getattr(amp, "dtype", None) == "fp16":
        raise ConfigError("daso with amp:fp16: the loss scaler skips steps per rank, which would "
                          "desynchronise daso's collectives; use amp:bf16")
    for name in plan.chosen:
        if name != "daso" and name in ("zero", "tri_accel", "ab", "lowrank"):
            raise ConfigError(f"daso synchronises the optimizer's parameters itself; {name} "
                              "changes them or the optimizer: drop one of them")
    context.check_batch_divides(plan, "daso")
    context.resolve_backend(opts.backend, plan.device, "daso", gloo_on_cuda=True)


class DASOSync:
    """The synchronisation schedule of one rank. `before_step` runs as the optimizer's step
    pre-hook (gradients ready), `after_step(t)` after optimizer step t (1-based)."""

    def __init__(self, params, opts: Options, total_steps: int, rank: int, world: int):
        self.params = [p for p in params if p.requires_grad]
        self.B, self.S, self.warmup, self.cooldown = opts.B, opts.S, opts.warmup, opts.cooldown
        self.total, self.wire = total_steps, WIRE[opts.wire]
        self.n = node_size(opts, world)
        self.rank, self.nodes = rank, world // self.n
        self.node, self.local = divmod(rank, self.n)
        # every rank creates every group, in the same order (torch.distributed requires it)
        node_groups = [dist.new_group(list(range(k * self.n, (k + 1) * self.n)))
                       for k in range(self.nodes)]
        self.global_groups = [dist.new_group([k * self.n + j for k in range(self.nodes)])
                              for j in range(self.n)]
        self.node_group = node_groups[self.node]
        self.t = 0  # optimizer steps completed
        self.syncs = 0  # global sends started
        self.pending: tuple | None = None  # (work, buffer, sent_step, active local index)
        self.rows: list[tuple[int, int, str, float]] = []
        self._grad_bytes = 0

    # -- phases ------------------------------------------------------------------------------
    def phase(self, t: int) -> str:
        if t <= self.warmup:
            return "warmup"
        if t > self.total - self.cooldown:
            return "cooldown"
        return "cycling"

    # -- every step ----------------------------------------------------------------------------
    @torch.no_grad()
    def before_step(self, optimizer=None, *args) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.phase(self.t + 1) == "cycling":
            if self.n > 1:
                self._average(grads, self.node_group, self.n)
        else:
            self._average(grads, None, self.nodes * self.n)

    def _average(self, tensors, group, size) -> None:
        flat = _flatten_dense_tensors(tensors)
        dist.all_reduce(flat, group=group)
        flat /= size
        for t, avg in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.copy_(avg)
        self._grad_bytes += flat.nbytes

    @torch.no_grad()
    def after_step(self, t: int) -> None:
        self.t = t
        param_bytes = 0
        if self.phase(t) == "cycling":
            if self.pending is not None and t == self.pending[2] + self.S:
                param_bytes += self._receive(t)
            if (t - self.warmup) % self.B == 0:
                param_bytes += self._send(t)
            if t == self.total - self.cooldown:  # last cycling step: cool-down starts in sync
                if self.pending is not None:
                    param_bytes += self._receive(t)
                param_bytes += self._blocking_average(t)
        self.rows += [(self.rank, t, "daso_grad_bytes", float(self._grad_bytes)),
                      (self.rank, t, "daso_param_bytes", float(param_bytes))]
        self._grad_bytes = 0

    def _send(self, t: int) -> int:
        active = self.syncs % self.n  # global groups take turns (the dissertation's GPU 'A', 'B', ...)
        self.syncs += 1
        work, buffer, sent = None, None, 0
        if self.local == active:
            buffer = _flatten_dense_tensors([p.detach() for p in self.params]).to(self.wire)
            work = dist.all_reduce(buffer, group=self.global_groups[active], async_op=True)
            sent = buffer.nbytes
        self.pending = (work, buffer, t, active)
        self.rows.append((self.rank, t, "daso_send", float(active)))
        return sent

    def _receive(self, t: int) -> int:
        work, buffer, sent_step, active = self.pending
        self.pending = None
        flat = _flatten_dense_tensors([p.detach() for p in self.params])
        if work is not None:
            work.wait()
            two_s = 2 * self.S  # eq. 3.2: local weighted 2S against the P stale global states
            flat = (two_s * flat + buffer.to(flat.dtype)) / (two_s + self.nodes)
        sent = 0
        if self.n > 1:  # the active member gives the merged state to its node
            dist.broadcast(flat, src=self.node * self.n + active, group=self.node_group)
            sent = flat.nbytes
        self._assign(flat)
        self.rows.append((self.rank, t, "daso_receive", float(t - sent_step)))
        return sent

    def _blocking_average(self, t: int) -> int:
        flat = _flatten_dense_tensors([p.detach() for p in self.params])
        dist.all_reduce(flat)
        flat /= self.nodes * self.n
        self._assign(flat)
        self.rows.append((self.rank, t, "daso_blocking", 1.0))
        return flat.nbytes

    def _assign(self, flat: torch.Tensor) -> None:
        for p, new in zip(self.params, _unflatten_dense_tensors(flat, self.params)):
            p.copy_(new)

    def series(self) -> list[tuple[int, int, str, float]]:
        return list(self.rows)


def apply(opts: Options, build: Build) -> None:
    context.shard_batch(build)
    model, rt = build.model, build.runtime
    for p in model.parameters():  # every replica starts from rank 0's parameters (as DDP)
        dist.broadcast(p.data, src=0)
    total = planned_steps(build.config, build.config.data.train_images,
                          chosen=build.plan.chosen)
    sync = DASOSync(model.parameters(), opts, total, context.rank(), context.world_size())
    factory = rt.optimizer_factory

    def optimizer_with_sync(m):
        optimizer = factory(m)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: sync.before_step(opt))
        return optimizer

    rt.optimizer_factory = optimizer_with_sync
    rt.step_hooks.append(lambda info: sync.after_step(info.step))
    rt.series_sources.append(sync.series)
    build.notes["daso"] = {"nodes": sync.nodes, "node_size": sync.n, "total_steps": total}


register(Technique("daso", Stage.PARALLEL, Options,
                   "DASO: node-local gradient averaging, non-blocking global parameter "
                   "averaging every B steps ([Coquelin] ch. 3)", apply, check,
                   order=10, shards_batch=True, owns_process_group=True, gloo_on_cuda=True))
