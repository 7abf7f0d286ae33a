"""Where a training step's host time goes: each timed step of one `memstudy run` timed on its
own (device synchronised) with the garbage collector's pauses in it, and Python's own profiler
around those steps, as a table of the functions with the most own time and the most time
under them, per step. `--no-profile` leaves the profiler out (real step times), `--gc-freeze`
freezes every object alive before the first timed step out of the collector's scans, and
`--gpu-timeline` reads each timed step's GPU timeline too (torch.profiler, CUDA activity
only): how long the GPU worked, how much of it was copies no kernel overlapped, and how long
it waited within the step.

    python benchmarks/bench_host_profile.py --out results/host --size 4188 --budget 4GiB \\
        --techniques amp:bf16,checkpoint,offload:which=boundaries:prefetch=1:hold=1,tile:auto,allocator:expandable_segments=true

Why: a tiled step launches about twice the tuned step's kernels, and its steps vary more than
its GPU's work per step does (docs/techniques/tile.md): whether the host sets the pace is
what this measures. CUDA's
profiler shows the kernels; this shows which Python does the launching, and how long the
step's own Python takes against its wall time. Only the steps after `--skip` are timed:
warm-up (cuDNN's autotuning, tile:auto's first plan) and the run's one metered step (its NVML
sampler thread runs beside it) come before them. From Python 3.12 the
profiler sees every thread (it is built on `sys.monitoring`): autograd's device thread, which
runs the backward's Python on CUDA (custom Functions, saved-tensor hooks, checkpoint's
recomputation), beside the main thread; "under `_train_step`" is the step's own. The profiler's own cost inflates every Python call alike,
so read the shares, not the absolute times.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import pstats
import sys
import time
from pathlib import Path

import torch

import memstudy.train as train
from memstudy.cli import main as memstudy_main
from memstudy.meters.profile import busy_ms, on_gpu


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for host-profile.md and the run's database")
    p.add_argument("-t", "--techniques", required=True)
    p.add_argument("--size", default="4188")
    p.add_argument("--budget", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps in all")
    p.add_argument("--skip", type=int, default=3,
                   help="steps before timing starts: warm-up, then the one step the meter "
                        "measures (its sampler thread would perturb a timed step); at least 2")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--no-profile", action="store_true",
                   help="no cProfile: only each step's wall time and the garbage collector's pauses")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() before the first timed step: every object alive then (the "
                        "model, the data, the run's bookkeeping) leaves the collector's scans")
    p.add_argument("--gpu-timeline", action="store_true",
                   help="each timed step under torch.profiler's CUDA activity too: the GPU's "
                        "busy time, the copies no kernel overlaps and its idle time in the step")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if args.gpu_timeline and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        p.error(f"--gpu-timeline reads the GPU's own timeline: it needs --device cuda on a "
                f"machine with a GPU (here --device {args.device}, CUDA "
                f"{'available' if torch.cuda.is_available() else 'not available'})")
    if not 2 <= args.skip < args.steps:
        p.error(f"--skip must be at least 2 (a warm-up step and the metered one) and below "
                f"--steps ({args.steps}), got {args.skip}")
    return args


class StepProfiler:
    """Wraps memstudy.train's step: the steps after `skip` are timed one by one (device
    synchronised before and after), with the garbage collector's pauses inside each, and
    (unless `profile` is off) run under one cProfile.Profile."""

    def __init__(self, skip: int, profile: bool = True, freeze: bool = False,
                 timeline: bool = False):
        self.skip, self.seen, self.freeze, self.timeline = skip, 0, freeze, timeline
        self.gpu: list[dict[str, float]] = []  # per timed step with `timeline`: gpu_figures
        self.walls_ms: list[float] = []
        self.gc_ms: list[float] = []  # per timed step, the collector's pauses
        self.gc_runs: list[dict[int, int]] = []  # per timed step, collections per generation
        self.profile = cProfile.Profile() if profile else None
        self._step = train._train_step
        self._gc_started = 0.0

    @property
    def timed(self) -> int:
        return len(self.walls_ms)

    def __call__(self, *args, **kwargs):
        self.seen += 1
        if self.seen <= self.skip:
            return self._step(*args, **kwargs)
        if self.freeze and self.seen == self.skip + 1:
            gc.collect()
            gc.freeze()
        with _gpu_timeline() if self.timeline else contextlib.nullcontext() as events:
            loss = self._timed(*args, **kwargs)
        if events is not None:  # the profiler has stopped: its events are read now
            self.gpu.append(gpu_figures(*events(), self.walls_ms[-1]))
        return loss

    def _timed(self, *args, **kwargs):
        _synchronize()
        self.gc_ms.append(0.0)
        self.gc_runs.append({})
        gc.callbacks.append(self._on_gc)
        started = time.perf_counter()
        if self.profile is not None:
            self.profile.enable()
        try:
            return self._step(*args, **kwargs)
        finally:
            if self.profile is not None:
                self.profile.disable()
            _synchronize()
            self.walls_ms.append(1e3 * (time.perf_counter() - started))
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        self.gc_ms[-1] += 1e3 * (time.perf_counter() - self._gc_started)
        runs = self.gc_runs[-1]
        runs[info["generation"]] = runs.get(info["generation"], 0) + 1


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def _gpu_timeline():
    """torch.profiler over the enclosed step, CUDA activity only (no Python or operator
    events, so the host runs as it would); yields a function that, once the profiler has
    stopped, returns the step's kernel and copy intervals (microseconds)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        yield lambda: _intervals(prof.events())


def _intervals(events) -> tuple[list[tuple[float, float]], dict[str, list[tuple[float, float]]]]:
    """Kernel intervals, and copy intervals by direction ("HtoD", "DtoH", the rest "other")."""
    kernels, copies = [], {"HtoD": [], "DtoH": [], "other": []}
    for event in events:
        if on_gpu(event):
            span = (event.time_range.start, event.time_range.end)
            if not event.name.startswith(("Memcpy", "Memset")):
                kernels.append(span)
                continue
            way = next((w for w in ("HtoD", "DtoH") if w in event.name), "other")
            copies[way].append(span)
    return kernels, copies


def gpu_figures(kernels: list[tuple[float, float]],
                copies: dict[str, list[tuple[float, float]]], wall_ms: float) -> dict[str, float]:
    """One step's GPU timeline: busy (kernels and copies, overlap counted once), the copies no
    kernel overlaps, the step's wall time the GPU did neither (waiting on the host), and how
    long kernels ran and copies to the device and to the host ran (each direction's copies
    overlapping one another counted once): a step whose copies one way run nearly all of it
    is bound by the link."""
    every_copy = [span for spans in copies.values() for span in spans]
    busy, kernel_busy = busy_ms(kernels + every_copy), busy_ms(kernels)
    return {"busy_ms": busy, "copies_alone_ms": busy - kernel_busy,
            "idle_ms": max(0.0, wall_ms - busy), "kernels_ms": kernel_busy,
            "to_device_ms": busy_ms(copies["HtoD"]), "to_host_ms": busy_ms(copies["DtoH"])}


def _where(key: tuple) -> str:
    file, line, name = key
    if file == "~":  # a built-in: its name says it (e.g. <built-in method conv2d ...>)
        return name
    for marker in ("site-packages/", "memstudy/", "benchmarks/", "python3."):
        if marker in file:  # no machine paths: the package's or the standard library's own
            file = file[file.index(marker):]
            break
    return f"{file}:{line} {name}"


def table(stats: pstats.Stats, steps: int, top: int, by: str) -> list[str]:
    """The `top` functions by own time (`by` = "own") or by time under them ("cumulative"),
    in ms per step."""
    column = 2 if by == "own" else 3
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][column])[:top]
    lines = ["| own ms / step | under it ms / step | calls / step | function |",
             "|---|---|---|---|"]
    for key, (_, calls, own, under, _) in rows:
        lines.append(f"| {1e3 * own / steps:.2f} | {1e3 * under / steps:.2f} | "
                     f"{calls / steps:.1f} | `{_where(key)}` |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = ["--db", str(out / "host-profile.sqlite"), "run", "--size", args.size, "-t",
           args.techniques, "--device", args.device, "--steps", str(args.steps), "-q",
           "--set", "meter.profile=false", "--set", f"train.warmup_steps={args.skip - 1}",
           "--set", "train.measure_steps=1"]  # every timed step a plain one (docs/metrics.md)
    if args.budget:
        run += ["--budget", args.budget]
    for item in args.set:
        run += ["--set", item]
    profiler = StepProfiler(args.skip, profile=not args.no_profile, freeze=args.gc_freeze,
                            timeline=args.gpu_timeline)
    train._train_step = profiler
    try:
        code = memstudy_main(run)
    finally:
        train._train_step = profiler._step
        if args.gc_freeze:
            gc.unfreeze()
    if code or not profiler.timed:
        print(f"bench_host_profile: the run ended with {code}, {profiler.timed} steps "
              "timed; nothing written", file=sys.stderr)
        return code or 1
    text = [*heading(args, profiler), *steps_table(profiler)]
    if profiler.profile is not None:
        stats, steps = pstats.Stats(profiler.profile), profiler.timed
        text += ["", "## By own time", "", *table(stats, steps, args.top, "own"),
                 "", "## By time under the function", "",
                 *table(stats, steps, args.top, "cumulative")]
    (out / "host-profile.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


def heading(args: argparse.Namespace, profiler: StepProfiler) -> list[str]:
    steps = profiler.timed
    how = ("under cProfile (its own cost included; read the shares); every thread's Python "
           "counted" if profiler.profile is not None else "without Python's profiler")
    if profiler.timeline:
        how += ("; each under torch.profiler's CUDA activity, which reads the GPU's timeline "
                "(and slows the host a little)")
    return [f"# Host time of {args.size} px, `{args.techniques}`"
            + (f" under {args.budget}" if args.budget else ""), "",
            f"{steps} steps timed after {args.skip}, on {_device_name(args.device)}, {how}"
            + ("; gc.freeze() before the first" if args.gc_freeze else "") + ": "
            f"{sum(profiler.walls_ms) / steps:.1f} ms a step, of it the garbage collector's "
            f"pauses {sum(profiler.gc_ms) / steps:.1f} ms.", ""]


# gpu_figures' keys -> the steps table's columns, in the table's order
GPU_COLUMNS = {"busy_ms": "GPU busy ms", "copies_alone_ms": "copies alone ms",
               "idle_ms": "GPU idle ms", "kernels_ms": "kernels ms",
               "to_device_ms": "copying to the device ms", "to_host_ms": "copying to the host ms"}


def steps_table(profiler: StepProfiler) -> list[str]:
    """Each timed step's wall time (device synchronised) and the collector's pauses in it;
    with the GPU's timeline, its busy, copies-alone and idle time and each kind's time too."""
    gpu_columns = GPU_COLUMNS if profiler.gpu else {}
    columns = ("step", "wall ms", *gpu_columns.values(), "gc pauses ms",
               "collections (generation: count)")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for index, (wall, paused, runs) in enumerate(zip(profiler.walls_ms, profiler.gc_ms,
                                                       profiler.gc_runs)):
        counts = ", ".join(f"{gen}: {n}" for gen, n in sorted(runs.items())) or "-"
        gpu = profiler.gpu[index] if profiler.gpu else {}
        cells = [f"{profiler.skip + index + 1}", f"{wall:.1f}",
                 *(f"{gpu[key]:.1f}" for key in gpu_columns), f"{paused:.1f}", counts]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "the CPU"


if __name__ == "__main__":
    sys.exit(main())
