"""allocator: settings of PyTorch's CUDA caching allocator, applied before CUDA initialises.

Memory / compute trade-off. The caching allocator takes memory from the driver in segments
and keeps freed blocks for reuse, so what a run *reserves* (what the device, and a budget,
must hold) exceeds what it *allocates* by the blocks cached but too small or too split for the
next request: fragmentation (`fragmentation_bytes` = peak reserved - peak allocated,
docs/metrics.md). Training on large images mixes huge activations with small temporaries, so
this gap can be gigabytes. The options (PYTORCH_CUDA_ALLOC_CONF's keys) reshape it:
- `expandable_segments`: a segment is a virtual address range that grows by mapping more
  physical pages, so a larger request extends the segment instead of needing a new one, and
  freed tail pages can be unmapped. Less fragmentation; costs page-mapping calls when a
  segment grows (mostly during warm-up).
- `garbage_collection_threshold` (0..1, 0 = off): once reserved memory passes this fraction
  of the allowed memory, cached blocks that are not in use are released to the driver before
  the allocator would otherwise have to free everything after a failed allocation. Lower
  reserved peaks near the limit; more cudaFree/cudaMalloc calls.
- `max_split_size_mb` (0 = unlimited): blocks above this size are never split, so large
  cached blocks stay whole for large requests instead of being carved into pieces that only
  small requests can reuse. Helps when large and small tensors alternate.

When. The allocator reads its settings when it is initialised, so they must be set before
CUDA starts in the run's process: `memstudy run`, every grid cell and every maxres probe is
its own process, and the runner applies the settings (`prepare`, through
compose.prepare_process) right after the plan is validated, before anything touches the GPU.
A process in which CUDA is already initialised is refused (a notebook after an earlier run,
or a technique whose check queried the GPU), and so is a second, different setting in the
same process: the allocator cannot be reconfigured.

What a run records about its allocator (memstudy/cuda_allocator.py, docs/metrics.md): the
settings string it was configured with and where from, and after the run the values the
allocator itself reports, compared with that string (`allocator_verified`).
"""
from __future__ import annotations

import os
import torch

from memstudy import cuda_allocator
from memstudy.errors import ConfigError
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import MIN_SPLIT_MB
from memstudy.techniques.options import AllocatorOptions as Options


def settings(opts: Options) -> str:
    """The PYTORCH_CUDA_ALLOC_CONF string of these options (unset ones left out)."""
    parts = [f"expandable_segments:{opts.expandable_segments}"]
    if opts.garbage_collection_threshold:
        parts.append(f"garbage_collection_threshold:{opts.garbage_collection_threshold}")
    if opts.max_split_size_mb:
        parts.append(f"max_split_size_mb:{opts.max_split_size_mb}")
    return ",".join(parts)


def check(opts: Options, plan: Plan) -> None:
    if plan.device.type != "cuda":
        raise ConfigError(f"allocator configures PyTorch's CUDA caching allocator but "
                          f"train.device resolves to {plan.device}; set train.device = 'cuda' "
                          "or drop allocator")
    if opts == Options():
        raise ConfigError("allocator with every option at its default changes nothing; set one, "
                          "e.g. allocator:expandable_segments=true")
    if not 0.0 <= opts.garbage_collection_threshold < 1.0:
        raise ConfigError(f"allocator: garbage_collection_threshold="
                          f"{opts.garbage_collection_threshold} must be within 0..1 (0 = off)")
    if opts.max_split_size_mb and opts.max_split_size_mb < MIN_SPLIT_MB:
        raise ConfigError(f"allocator: max_split_size_mb={opts.max_split_size_mb} must be >= "
                          f"{MIN_SPLIT_MB} (PyTorch's large-block size) or 0 (unlimited)")
    for var in cuda_allocator.ENV_VARS:
        external = os.environ.get(var)
        if external:
            raise ConfigError(f"allocator: {var}={external!r} is set in the environment and "
                              "would mix with the technique's settings; unset it and give its "
                              "options to the allocator technique")


def _check_process(opts: Options) -> None:
    """Refuse a process whose allocator can no longer take these settings."""
    wanted, applied = settings(opts), cuda_allocator.applied()
    if applied == wanted:
        return  # this process was prepared for exactly this (a distributed rank, a rerun)
    if applied is not None:
        raise ConfigError(f"allocator: this process's CUDA allocator was already given "
                          f"{applied!r}; it cannot be reconfigured to {wanted!r}: run it in a "
                          "fresh process (memstudy run, a grid cell or a maxres probe)")
    if torch.cuda.is_initialized():
        raise ConfigError("allocator: CUDA is already initialised in this process (an earlier "
                          "run, or a technique's check that queried the GPU), so the caching "
                          "allocator's settings can no longer take effect; run it in a fresh "
                          "process (memstudy run, a grid cell or a maxres probe)")


def prepare(opts: Options, plan: Plan) -> None:
    """Give the caching allocator these settings, in the run's own process before CUDA
    initialises (not in `check`: a grid or maxres parent validates plans whose runs get
    fresh processes)."""
    _check_process(opts)
    wanted = settings(opts)
    if cuda_allocator.applied() != wanted:
        try:
            cuda_allocator.configure(wanted)
        except (RuntimeError, ValueError) as exc:  # PyTorch's own refusal, named
            raise ConfigError(f"allocator: PyTorch refused {wanted!r}: {exc}") from None


def apply(opts: Options, build: Build) -> None:
    build.notes["allocator"] = settings(opts)


register(Technique("allocator", Stage.PROCESS, Options,
                   "CUDA caching-allocator settings (expandable segments, GC threshold, max "
                   "split size): less fragmentation, fewer reserved bytes", apply, check,
                   prepare=prepare))
