"""How host-bound a training step is: kernel launches and GPU-busy time of one step.

A step whose GPU waits on the host (many small kernels, each launched from Python) takes longer
than its kernels: "host-bound" becomes a number here. With `meter.profile = true` the training
loop runs its last warm-up step (after cuDNN's autotuning and any graph capture of the first)
under torch.profiler and records, as run-level series rows (step 0):
- `launches_per_step`: host launch calls (cudaLaunchKernel and its variants, and
  cudaGraphLaunch: a replayed CUDA graph is one launch however many kernels it holds);
- `kernels_per_step`: kernels that ran on the GPU;
- `gpu_busy_ms_per_step`: the union of the GPU's kernel and copy intervals (overlapping work
  counted once);
- `profiled_step_ms`: that step's wall time under the profiler (the profiler's own cost
  included: compare busy time with the unprofiled `step_time_s`, not with this).
Warm-up is never measured, so the profiler perturbs no recorded phase or step time.
For diagnosis, the environment variable MEMSTUDY_PROFILE_TABLE names a file to which the
profiled step's kernels, by GPU time (torch.profiler's key_averages table), are appended.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaGraphLaunch", "cudaLaunchCooperativeKernel")


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals in microseconds, as milliseconds."""
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1000


@contextlib.contextmanager
def step_profile(series: list, rank: int, device: torch.device):
    """Profile the enclosed step; append its rows to `series` (docs/metrics.md)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        yield
        torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - t0) * 1000
    launches, gpu = 0, []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            gpu.append((event.time_range.start, event.time_range.end))
        elif event.name in LAUNCHES:
            launches += 1
    table = os.environ.get("MEMSTUDY_PROFILE_TABLE")
    if table:
        with open(table, "a") as out:
            out.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40) + "\n")
    series += [(rank, 0, "launches_per_step", float(launches)),
               (rank, 0, "kernels_per_step", float(len(gpu))),
               (rank, 0, "gpu_busy_ms_per_step", busy_ms(gpu)),
               (rank, 0, "profiled_step_ms", wall_ms)]
