"""Where the caching allocator gave memory back to make room: the allocations that found none.

Under a memory budget the caching allocator may reach its cap with free memory still cached
in blocks of the wrong size or place. It then releases cached blocks (cudaFree, or with
expandable segments unmapping their pages: either synchronises the device), first those large
enough for the request, then, if that fails, all of them, and tries again. The full release is
a retry, counted by `num_alloc_retries` (series `alloc_retries`, docs/metrics.md) but not
located by it; the partial one is not counted at all.

For diagnosis, the environment variable MEMSTUDY_ALLOC_TRACE names a file: the step that
`meter.profile` profiles (the last warm-up step, never measured) then also runs with
PyTorch's allocator history on (`torch.cuda.memory._record_memory_history`, Python stacks),
and `release_table` appends to the file each release of that step (a run of consecutive
`segment_free` / `segment_unmap` events): what it gave back, the request that followed it
(size, stream), and where in Python the request came from. Recording stacks costs host time,
which the warm-up step absorbs.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

ENV = "MEMSTUDY_ALLOC_TRACE"
PACKAGE = str(Path(__file__).resolve().parents[1])  # memstudy's own source files
RELEASES = ("segment_free", "segment_unmap")  # memory given back (a retry, or empty_cache)


def releases(trace: list[dict]) -> list[dict]:
    """One entry per run of consecutive releases in an allocator trace: the bytes released,
    then the first allocation after the run (the one that made room), or None if none came."""
    found, i = [], 0
    while i < len(trace):
        if trace[i]["action"] not in RELEASES:
            i += 1
            continue
        released = 0
        while i < len(trace) and trace[i]["action"] in RELEASES:
            released += trace[i]["size"]
            i += 1
        request = next((e for e in trace[i:] if e["action"] == "alloc"), None)
        found.append({"released": released, "request": request})
    return found


def _frame(frame: dict) -> str:
    return (f"{frame.get('name', '?')} ({os.path.basename(frame.get('filename', '?'))}:"
            f"{frame.get('line', '?')})")


def _where(frames: list[dict], depth: int = 2) -> str:
    """The innermost `depth` frames of any code (the operation that asked: a convolution's
    workspace and its output come from the same line), then, if not among them, the innermost
    frame of memstudy's own code (which of its regions, sweeps or losses ran it)."""
    picked = frames[:depth]
    ours = next((f for f in frames if f.get("filename", "").startswith(PACKAGE)), None)
    if ours is not None and ours not in picked:
        picked = picked + [ours]
    return " < ".join(_frame(f) for f in picked)


def release_table(trace: list[dict]) -> str:
    """The releases of a trace as a Markdown table (MB = 1e6 bytes)."""
    found = releases(trace)
    lines = [f"Allocator cache releases in the profiled step: {len(found)}",
             "| # | released MB | then requested MB | stream | requested from |",
             "|---|---:|---:|---|---|"]
    for n, release in enumerate(found, 1):
        request = release["request"]
        if request is None:
            lines.append(f"| {n} | {release['released'] / 1e6:.1f} | - | - | "
                         "(no request after it) |")
            continue
        lines.append(f"| {n} | {release['released'] / 1e6:.1f} | {request['size'] / 1e6:.1f} | "
                     f"{request.get('stream', '?')} | {_where(request.get('frames', []))} |")
    return "\n".join(lines)


@contextlib.contextmanager
def traced(device: torch.device):
    """Record the allocator's history over the enclosed step when MEMSTUDY_ALLOC_TRACE names a
    file; append the step's releases to it."""
    path = os.environ.get(ENV)
    if not path:
        yield
        return
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=1_000_000, device=device)
    try:
        yield
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with open(path, "a") as out:
        out.write(release_table(snapshot["device_traces"][index]) + "\n")
