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
profiled step's kernels, by GPU time (torch.profiler's key_averages table), are appended, then
the same GPU time attributed to where it was spent (`attribution_table`: per op, its input
shapes, its callers up to the nearest labelled range such as a tile region's sweep), and how
much of the host <-> device copies' time overlapped other GPU work, beside the host's longest
CUDA runtime calls (`copy_overlap`: a copy that overlaps nothing is on the critical path), and
where those exposed copies are (`exposed_copies`: who issued each, the kernel the GPU ran next,
and whether that kernel was launched before the copy ended, so the GPU waited for the copy).
MEMSTUDY_ALLOC_TRACE does the same for the allocator's cache releases (retries) in that step
(alloc_trace).
"""
from __future__ import annotations

import bisect
import contextlib
import os
import time

import torch

from memstudy.errors import ConfigError
from memstudy.meters import alloc_trace

TABLE_ENV = "MEMSTUDY_PROFILE_TABLE"


def check_diagnosis_files() -> None:
    """The files the diagnosis variables name (MEMSTUDY_PROFILE_TABLE, MEMSTUDY_ALLOC_TRACE)
    can be appended to: checked as a run starts, not after its warm-up."""
    for name in (TABLE_ENV, alloc_trace.ENV):
        path = os.environ.get(name)
        if not path:
            continue
        try:
            with open(path, "a"):
                pass
        except OSError as exc:
            raise ConfigError(f"{name}={path!r}: cannot write there ({exc.strerror}); name a "
                              "writable file or unset it") from None


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaGraphLaunch", "cudaLaunchCooperativeKernel")


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals in microseconds, as milliseconds."""
    return sum(stop - start for start, stop in _union(intervals)) / 1000


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The sorted, disjoint intervals covering the same time as `spans`."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _is_runtime_call(event) -> bool:
    """A CUDA runtime or driver call on the host (a launch, copy, memset, sync), not cuDNN."""
    return event.name.startswith("cu") and not event.name.startswith("cudnn")


def on_gpu(event) -> bool:
    """A kernel or copy that ran on the GPU. A profiler range (record_function, such as a tile
    region's sweep label) is mirrored on the GPU's timeline as a user annotation spanning all
    the work launched inside it, idle gaps included: not GPU work."""
    return (event.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(event, "is_user_annotation", False))


@contextlib.contextmanager
def step_profile(series: list, rank: int, device: torch.device):
    """Profile the enclosed step; append its rows to `series` (docs/metrics.md)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    table = os.environ.get(TABLE_ENV)
    with torch.profiler.profile(activities=activities, record_shapes=bool(table)) as prof:
        t0 = time.perf_counter()
        with alloc_trace.traced(device):  # MEMSTUDY_ALLOC_TRACE: where the allocator made room
            yield
        torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - t0) * 1000
    launches, gpu = 0, []
    for event in prof.events():
        if on_gpu(event):
            gpu.append((event.time_range.start, event.time_range.end))
        elif event.name in LAUNCHES:
            launches += 1
    if table:
        with open(table, "a") as out:
            out.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40) + "\n")
            out.write(attribution_table(prof.events()) + "\n")
            out.write(copy_overlap(prof.events()) + "\n")
            out.write(exposed_copies(prof.events()) + "\n")
    series += [(rank, 0, "launches_per_step", float(launches)),
               (rank, 0, "kernels_per_step", float(len(gpu))),
               (rank, 0, "gpu_busy_ms_per_step", busy_ms(gpu)),
               (rank, 0, "profiled_step_ms", wall_ms)]


def _callers(event, depth: int = 3) -> str:
    """The `depth` ops above `event`, innermost first, then the nearest labelled range above
    them (a name with a colon that is not an aten or autograd op: tile regions label their
    sweeps, memstudy/tiling/sweep.py)."""
    names, parent = [], event.cpu_parent
    while parent is not None:
        name = parent.name.replace("autograd::engine::evaluate_function: ", "")
        labelled = ":" in name and not name.startswith(("aten::", "autograd::"))
        if labelled or len(names) < depth:
            names.append(name)
        if labelled:
            break
        parent = parent.cpu_parent
    return " < ".join(names)


def attribution_table(events, rows: int = 60) -> str:
    """GPU time of the profiled step by (op, input shapes, callers), largest first."""
    spent: dict[tuple[str, str, str], list[float]] = {}
    total = 0.0
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA or not event.self_device_time_total:
            continue
        shapes = ",".join("x".join(map(str, s)) for s in (event.input_shapes or []) if s)
        key = (event.name, shapes, _callers(event))
        entry = spent.setdefault(key, [0.0, 0])
        entry[0] += event.self_device_time_total / 1000
        entry[1] += 1
        total += event.self_device_time_total / 1000
    lines = [f"GPU time by op, input shapes and callers ({total:.1f} ms in all)",
             "| ms | calls | op | input shapes | callers |", "|---|---|---|---|---|"]
    for (name, shapes, callers), (ms, calls) in sorted(spent.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"| {ms:.1f} | {calls} | {name} | {shapes[:80]} | {callers} |")
    return "\n".join(lines)


COPIES = ("Memcpy HtoD", "Memcpy DtoH")


def _overlap_ms(interval: tuple[float, float], others: list[tuple[float, float]]) -> float:
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in others) / 1000


def copy_overlap(events) -> str:
    """Host <-> device copies: their time, and how much of it other streams' kernels overlapped;
    then the CUDA runtime calls the host spent longest in (synchronisations show here)."""
    kernels: dict[int, list[tuple[float, float]]] = {}
    copies: dict[str, list[tuple[int, tuple[float, float]]]] = {}
    runtime: dict[str, list[float]] = {}
    for e in events:
        span = (e.time_range.start, e.time_range.end)
        if on_gpu(e):
            stream = getattr(e, "device_resource_id", 0)
            kind = next((c for c in COPIES if e.name.startswith(c)), None)
            if kind:
                copies.setdefault(kind, []).append((stream, span))
            else:
                kernels.setdefault(stream, []).append(span)
        elif _is_runtime_call(e):
            entry = runtime.setdefault(e.name, [0.0, 0])
            entry[0] += (span[1] - span[0]) / 1000
            entry[1] += 1
    lines = ["| copies | ms | overlapped by kernels of other streams, ms |", "|---|---|---|"]
    for kind, spans in copies.items():
        total = sum(b - a for _s, (a, b) in spans) / 1000
        hidden = sum(_overlap_ms(span, [k for other, ks in kernels.items() if other != stream
                                        for k in ks]) for stream, span in spans)
        lines.append(f"| {kind} ({len(spans)}) | {total:.1f} | {hidden:.1f} |")
    lines += ["", "| CUDA runtime call | host ms | calls |", "|---|---|---|"]
    for name, (ms, calls) in sorted(runtime.items(), key=lambda kv: -kv[1][0])[:12]:
        lines.append(f"| {name} | {ms:.1f} | {calls} |")
    return "\n".join(lines)


def _subtract(span: tuple[float, float], union: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of `span` that no interval of the sorted, disjoint `union` covers."""
    start, end = span
    pieces = []
    first = max(0, bisect.bisect_left(union, (start, start)) - 1)  # may cover `start`
    for a, b in union[first:]:
        if a >= end:
            break
        if b <= start:
            continue
        if a > start:
            pieces.append((start, a))
        start = max(start, b)
    if start < end:
        pieces.append((start, end))
    return pieces


def _issuer(event, runtime: dict) -> str:
    """The op that launched a GPU event, with its callers: the CUDA runtime call sharing the
    event's correlation id (a launch, copy or memset) runs inside that op."""
    call = runtime.get(event.id)
    op = call.cpu_parent if call is not None else None
    if op is None:
        return "?"
    callers = _callers(op, depth=2)
    return op.name + (" < " + callers if callers else "")


def exposed_copies(events, rows: int = 25, min_us: float = 20.0) -> str:
    """The host <-> device copy time during which no kernel of any stream runs, grouped by the
    op that issued the copy, the op of the first kernel to start after each exposed piece, and
    why the GPU idled: `waited` when that kernel was launched before the piece ended (the GPU
    had work queued behind the copy: an event wait, or the allocator's), `host` when it was
    launched later (nothing was queued)."""
    runtime, kernels, copies = {}, [], []
    for e in events:
        if on_gpu(e):
            (copies if e.name.startswith(COPIES) else kernels).append(e)
        elif _is_runtime_call(e):
            runtime[e.id] = e  # keyed by correlation id, which its GPU event shares
    kernels.sort(key=lambda k: k.time_range.start)
    starts = [k.time_range.start for k in kernels]
    origin = min(starts[:1] + [c.time_range.start for c in copies], default=0.0)
    busy = _union([(k.time_range.start, k.time_range.end) for k in kernels])
    groups: dict[tuple[str, str, str, str], list[float]] = {}
    total = 0.0
    for copy in copies:
        for a, b in _subtract((copy.time_range.start, copy.time_range.end), busy):
            if b - a < min_us:
                continue
            after = bisect.bisect_left(starts, b)
            nxt = kernels[after] if after < len(kernels) else None
            launch = runtime.get(nxt.id) if nxt is not None else None
            why = "-" if launch is None else ("waited" if launch.time_range.start < b else "host")
            key = (copy.name.split(" ")[1], _issuer(copy, runtime),
                   _issuer(nxt, runtime) if nxt is not None else "-", why)
            entry = groups.setdefault(key, [0.0, 0, float("inf")])
            entry[0] += (b - a) / 1000
            entry[1] += 1
            entry[2] = min(entry[2], (a - origin) / 1000)  # events need not come in time order
            total += (b - a) / 1000
    lines = [f"Copy time with no kernel running ({total:.1f} ms in pieces of {min_us:.0f} us or "
             "more; `first at`: ms after the step's first GPU work)",
             "| ms | pieces | first at | copy | issued by | next kernel's op | GPU |",
             "|---|---|---|---|---|---|---|"]
    for (kind, issuer, nxt, why), (ms, n, first) in sorted(groups.items(),
                                                          key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"| {ms:.1f} | {n} | {first:.1f} | {kind} | {issuer} | {nxt} | {why} |")
    return "\n".join(lines)
