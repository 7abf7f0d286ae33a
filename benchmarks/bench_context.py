"""What the CUDA context holds, and which settings shrink it (issue: the 2 GiB rung).

A budget covers the CUDA context, which on some GPUs is a third of 4 GiB and two thirds of
2 GiB (docs/budget.md). The context is not the caching allocator's: it is the driver's own
memory (per-SM local memory, the printf / malloc heaps) and the code of every kernel module
loaded so far (PyTorch's, cuBLAS's, cuDNN's engines, Triton's), which grows as new kernels are
first used. Each measurement runs in a fresh process, since a context only grows:

- `stages`: NVML's used bytes minus the allocator's reserved bytes, minus the device's used
  bytes before the process touched CUDA, after each first use: the driver's context alone
  (libcuda through ctypes, no PyTorch), PyTorch's context (torch.cuda.init), a bf16 matrix
  product (cuBLAS / cuBLASLt), a bf16 convolution forward + backward (cuDNN, autotuned or not),
  a BatchNorm forward + backward, memstudy's Triton BatchNorm kernels;
- `run`: a training run of a set (default: tile:auto's, 4188 px under 4 GiB), whose record
  holds the context at its start and after its warm-up steps, and its step time.

Each under settings that are documented to change what is loaded: CUDA_MODULE_LOADING=EAGER
(every module of a library loaded at once; LAZY, the default, loads a kernel when first used)
and cuDNN autotuning off (`train.cudnn_benchmark=false`: cuDNN's heuristic picks one engine
per shape instead of trying several, each loaded).

    python benchmarks/bench_context.py --out benchmarks/results/h200/context
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MIB = 1 << 20
# name -> (environment, cudnn.benchmark)
VARIANTS = {
    "default": ({}, True),
    "cudnn-benchmark-off": ({}, False),
    "eager-loading": ({"CUDA_MODULE_LOADING": "EAGER"}, True),
}
RUN_VARIANTS = ("default", "cudnn-benchmark-off")


def _used() -> int:
    from memstudy.budget import nvml_used  # NVML's figure, without creating a context

    return nvml_used(0)


def _gpu_name() -> str:
    """Without creating a CUDA context in this process (each child measures its own)."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))


def driver_context() -> int:
    """Bytes the driver's primary context takes on device 0 with nothing loaded into it."""
    before = _used()
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    for status in (cuda.cuInit(0), cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0),
                   cuda.cuCtxSetCurrent(ctx), cuda.cuCtxSynchronize()):
        if status != 0:
            raise RuntimeError(f"libcuda returned {status}")
    return _used() - before


def stages(cudnn_benchmark: bool) -> list[tuple[str, int]]:
    """(first use, context bytes after it): NVML used - before - the allocator's reserved."""
    import torch
    import torch.nn.functional as F

    from memstudy.tiling import norm_act

    before = _used()
    torch.backends.cudnn.benchmark = cudnn_benchmark
    out: list[tuple[str, int]] = []

    def mark(what: str) -> None:
        torch.cuda.synchronize()
        out.append((what, _used() - before - torch.cuda.memory_reserved()))

    torch.cuda.init()
    torch.empty(1, device="cuda")
    mark("PyTorch's context (torch.cuda.init, one tensor)")
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    mark("+ cuBLAS: a bf16 matrix product")
    x = torch.randn(1, 64, 512, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    F.conv2d(x, w, padding=1).sum().backward()
    mark("+ cuDNN: a bf16 3x3 convolution, forward + backward")
    bn = torch.nn.BatchNorm2d(64).cuda()
    bn(x.detach().float().requires_grad_()).sum().backward()
    mark("+ cuDNN: BatchNorm forward + backward")
    z = torch.randn(1, 64, 256, 256, device="cuda", dtype=torch.bfloat16).to(
        memory_format=torch.channels_last)  # the layout the kernels take (norm_act.supported)
    if norm_act.supported(z):
        _, mean, var = norm_act.moments(z)
        scale = torch.ones(64, device="cuda")
        norm_act.affine_act(z, mean, scale, torch.zeros(64, device="cuda"), relu=True)
        mark("+ Triton: memstudy's BatchNorm kernels (moments, normalise + ReLU)")
    return out


def run(techniques: str, size: int, budget: str, steps: int, cudnn_benchmark: bool) -> dict:
    from memstudy.config import RunConfig
    from memstudy.runner import execute

    cfg = RunConfig(techniques=techniques.split(","), budget=budget)
    cfg.train.image_size, cfg.train.steps, cfg.train.epochs = size, steps, 1
    cfg.train.warmup_steps = 2  # the context is measured again after these
    cfg.data.train_images, cfg.data.val_images = 4, 1  # phantoms drawn on the host: few
    if not cudnn_benchmark:  # unset: on for CUDA (docs/metrics.md)
        cfg.train.cudnn_benchmark = False
    rec = execute(cfg, None)
    step = [v for rank, phase, name, v in rec.metrics
            if rank == 0 and phase == "run" and name == "step_time_s"]
    return {"status": rec.status, "error": rec.error,
            "context_start": rec.env.get("cuda_context_bytes"),
            "context_after_warmup": rec.env.get("cuda_context_after_warmup_bytes"),
            "step_s": step[0] if step else None, "picked": rec.env.get("notes", {}).get("tile", {}).get("says")}


def child(args: argparse.Namespace) -> None:
    env, bench = VARIANTS[args.variant]
    if args.child == "driver":
        print(json.dumps({"driver": driver_context()}))
    elif args.child == "stages":
        print(json.dumps({"stages": stages(bench)}))
    else:
        print(json.dumps({"run": run(args.set, args.size, args.budget, args.steps, bench)}))


def spawn(kind: str, variant: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, **VARIANTS[variant][0])
    cmd = [sys.executable, __file__, "--child", kind, "--variant", variant, "--set", args.set,
           "--size", str(args.size), "--budget", args.budget, "--steps", str(args.steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    if proc.returncode or not last[0].startswith("{"):
        return {"failed": proc.stderr.strip().splitlines()[-3:]}
    return json.loads(last[0])


def table(results: dict, args: argparse.Namespace) -> list[str]:
    lines = ["# What the CUDA context holds\n", f"GPU: {results['gpu']}; {results['date']}; "
             "benchmarks/bench_context.py. MiB of the device's memory that is neither the "
             "caching allocator's nor there before the process started (NVML), after each "
             "first use, each variant in a fresh process.\n",
             f"The driver's context alone (libcuda, nothing loaded): "
             f"**{(results['driver'] or 0) / MIB:.0f} MiB**.\n",
             "| first use | " + " | ".join(VARIANTS) + " |", "|---" * (len(VARIANTS) + 1) + "|"]
    names = [s for s, _ in results["stages"].get("default", [])]
    for i, name in enumerate(names):
        cells = [f"{results['stages'][v][i][1] / MIB:.0f}"
                 if len(results["stages"].get(v, [])) > i else "-" for v in VARIANTS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [f"\n## A training run: `{args.set}`, {args.size} px under {args.budget}, "
              f"{args.steps} steps\n", "| variant | status | context at start MiB | "
              "after warm-up MiB | step s |", "|---|---|---|---|---|"]
    for v, r in results["runs"].items():
        mib = [f"{r[k] / MIB:.0f}" if r.get(k) else "-"
               for k in ("context_start", "context_after_warmup")]
        step = f"{r['step_s']:.3f}" if r.get("step_s") else "-"
        lines.append(f"| {v} | {r.get('status', r.get('failed'))} | {mib[0]} | {mib[1]} | "
                     f"{step} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out")
    p.add_argument("--child", choices=("driver", "stages", "run"))
    p.add_argument("--variant", default="default", choices=tuple(VARIANTS))
    p.add_argument("--set", default="amp:bf16,checkpoint,offload:which=boundaries:prefetch=1,"
                   "tile:auto,allocator:expandable_segments=true")
    p.add_argument("--size", type=int, default=4188)
    p.add_argument("--budget", default="4GiB")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if not args.out:
        p.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"gpu": _gpu_name(), "date": time.strftime("%Y-%m-%d"),
               "driver": spawn("driver", "default", args).get("driver"), "stages": {}, "runs": {}}
    for v in VARIANTS:
        results["stages"][v] = spawn("stages", v, args).get("stages", [])
        write(results, args, out)
    for v in RUN_VARIANTS:
        results["runs"][v] = spawn("run", v, args).get("run", {})
        write(results, args, out)
    return 0


def write(results: dict, args: argparse.Namespace, out: Path) -> None:
    """After each measurement: what a time limit stops is not lost."""
    (out / "context.json").write_text(json.dumps(results, indent=1))
    text = "\n".join(table(results, args)) + "\n"
    (out / "context.md").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
