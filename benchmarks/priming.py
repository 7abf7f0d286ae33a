"""Priming: every configuration of a benchmark run once, unrecorded, before its recorded runs.

In one process the first run at a given shape and dtype pays cuDNN autotuning
(`cudnn.benchmark`), lazy CUDA / cuBLAS initialisation and the first compilation of Triton
kernels. On an H100 that was 10-20 s against runs of 6-13 s (bench_accumulate, 2026-11-22: 18 s
for the first k of a size, 6-8 s for the others). Per-step figures exclude it (warm-up), but
the run-level ones do not: `energy_j`, `time_to_target_s` and wall time would charge it to
whichever variant happens to run first. Priming runs each configuration once with no database,
so that every recorded run finds the caches warm. It doubles a benchmark's time; `--no-prime`
restores the former order-dependent figures.
"""
from __future__ import annotations

import argparse
import copy
import time

from memstudy.config import RunConfig
from memstudy.errors import ConfigError
from memstudy.runner import execute


def add_prime_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prime", action=argparse.BooleanOptionalAction, default=True,
                        help="run every configuration once, unrecorded, before the recorded "
                             "runs (cuDNN autotuning and lazy initialisation out of the "
                             "run-level figures; benchmarks/priming.py)")


def prime(configs: list[RunConfig], enabled: bool = True, say=print) -> None:
    """Run each configuration once with no database. A priming run that fails is reported and
    skipped: its recorded twin will fail the same way and record why. A configuration memstudy
    refuses stops the benchmark with memstudy's message, before anything is recorded."""
    if not enabled:
        return
    for cfg in configs:
        t0 = time.perf_counter()
        try:
            rec = execute(copy.deepcopy(cfg), db=None)
        except ConfigError as e:
            raise SystemExit(f"{cfg.techniques}: {e}") from None
        say(f"primed {cfg.label or ''} {cfg.techniques}: {rec.status} "
            f"({time.perf_counter() - t0:.0f} s)")


def primed_note(enabled: bool) -> str:
    """The sentence a benchmark's table states its runs' order under."""
    return ("Every configuration was first run once, unrecorded, in the same process "
            "(benchmarks/priming.py): run-level figures (energy, time to target, wall) exclude "
            "cuDNN autotuning and lazy initialisation." if enabled else
            "Not primed (--no-prime): the first run at each shape also pays cuDNN autotuning "
            "and lazy initialisation in its energy, time to target and wall time.")
