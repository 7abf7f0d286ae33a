"""Who this process is in a distributed run, and the checks every distributed technique shares.

A run with `world_size` N > 1 is N processes, one per GPU (or N CPU processes on gloo).
Techniques validate against `plan.config.world_size` (known before any process starts), and
act on the process group once it exists (`rank()`, `world_size()`).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from memstudy.errors import ConfigError
from memstudy.store import RANK_MAX, RANK_MEAN  # noqa: F401 (metrics rows of the mean / max over ranks)
BACKENDS = ("auto", "nccl", "gloo")  # the `backend` option of every process-group owner


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def local_rank() -> int:
    """Index of this process among those of its host (torchrun's LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", rank()))


def local_world_size(config_world: int) -> int:
    """Processes on this host: torchrun says so for several hosts; else all of them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", config_world))


def rank_device(device: torch.device) -> torch.device:
    """One process per GPU: rank r of a host trains on cuda:<local rank>."""
    if device.type == "cuda" and is_distributed():
        return torch.device("cuda", local_rank())
    return device


def resolve_backend(requested: str, device: torch.device, owner: str, gloo_on_cuda: bool) -> str:
    """The collective backend for `device`; refuses one the device cannot use, naming the fix."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ConfigError(f"{owner}:backend=nccl needs CUDA GPUs but train.device is "
                          f"{device.type}; use {owner}:backend=gloo (or auto) or train.device=cuda")
    if requested == "nccl" and not dist.is_nccl_available():
        raise ConfigError(f"{owner}:backend=nccl but this PyTorch has no NCCL; use backend=gloo")
    if requested == "gloo" and device.type == "cuda" and not gloo_on_cuda:
        raise ConfigError(f"{owner}:backend=gloo cannot move CUDA tensors the way {owner} needs "
                          f"(point-to-point / reduce-scatter); use {owner}:backend=nccl or auto")
    return requested


def check_world(plan, owner: str, min_world: int = 2, exact: int | None = None) -> None:
    """Shared refusals of a process-group technique: world size, one GPU per process, device.
    (That at most one technique owns the group is a composition rule: compose.check_declared.)"""
    cfg = plan.config
    ws = cfg.world_size
    if exact is not None and ws != exact:
        raise ConfigError(f"{owner} needs world_size = {exact} (got {ws}); set "
                          f"--set world_size={exact}")
    if ws < min_world:
        raise ConfigError(f"{owner} needs world_size >= {min_world} processes (got {ws}); set "
                          f"--set world_size=2 (one process per GPU)")
    if plan.device.type == "cuda":
        if plan.device.index is not None:
            raise ConfigError(f"train.device = {cfg.train.device!r} pins one GPU, but under "
                              f"world_size {ws} each process takes the GPU of its local rank; "
                              "use train.device = cuda (or auto)")
        local = local_world_size(ws)
        if local > plan.n_gpus:
            raise ConfigError(f"world_size {ws} starts {local} processes on this host, one per "
                              f"GPU, but only {plan.n_gpus} GPU(s) are visible; lower world_size")


def check_batch_divides(plan, owner: str) -> None:
    """Data parallelism splits train.batch_size over the ranks: it must divide evenly."""
    b, ws = plan.config.train.batch_size, plan.config.world_size
    if b % ws:
        fits = sorted({max(ws, b // ws * ws), (b // ws + 1) * ws})
        raise ConfigError(f"{owner}: train.batch_size {b} is the global batch and must be "
                          f"divisible by world_size {ws}; use train.batch_size "
                          f"{' or '.join(map(str, fits))}")
    images = getattr(plan.config.data, "train_images", None)
    if plan.config.data.source == "synthetic" and images is not None and images < b:
        raise ConfigError(f"{owner}: data.train_images {images} is smaller than one global batch "
                          f"(train.batch_size {b}); every step needs a full global batch")


def shard_batch(build) -> None:
    """Data parallel: each rank draws batch_size / N images of every global batch."""
    n = world_size()
    if n != build.config.world_size:
        raise RuntimeError(f"process group has {n} ranks but world_size is "
                           f"{build.config.world_size}; start the run with `memstudy run`")
    build.runtime.batch_size = build.config.train.batch_size // n
    build.runtime.shard = (rank(), n)
    build.runtime.rank = rank()
