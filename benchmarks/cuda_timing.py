"""One CUDA-event timer for the kernel benchmarks (bench_kernels, bench_compress, bench_triaccel)."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], repeat: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of fn() timed by CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
