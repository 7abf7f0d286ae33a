"""Gradient accumulation against the larger batch ([Compute-Opt] (docs/references.md) eq. 4-9): GPU benchmark, run by the lead.

    python benchmarks/bench_accumulate.py --out benchmarks/results/h100/accumulate [--sizes 1024 2048]

At each size, one effective batch B (default 8) trained four ways: batch B (k = 1), and
batch B/k with `accumulate:k` for k = 2, 4, 8 (the same images per optimizer step, the same
optimizer steps: 16 phantoms x 3 epochs = 6 optimizer steps, 2 warm-up + 2 measured, 3
validations for the time to target). Rows are printed and accumulate.md rewritten as each
run ends, so a run cut by a time limit leaves the rows it finished. Synthetic phantoms, every
row with the --base set (default amp:bf16; the tuned baseline's channels_last / cuDNN
autotuning as resolved for CUDA), `--epochs` epochs validated after each, every row first run once unrecorded
(benchmarks/priming.py; --no-prime skips it: the first k of each size then carries cuDNN
autotuning in its energy and time to target),
train.target_val_loss = --target. Rows: peak memory (allocator, and NVML device level), step
time, throughput, energy (NVML counter), time to target, validation loss; then memstudy's eq. 9
table
(memstudy.report.accumulation: throughput / peak per k, k_optimal marked). Writes
accumulate.sqlite and accumulate.md into --out. BatchNorm makes k > 1 train differently from
batch B (per-micro-batch statistics; docs/techniques/accumulate.md), so the loss columns differ.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from memstudy.byte_sizes import MB
from memstudy.config import RunConfig
from memstudy.report import accumulation, render
from memstudy.runner import execute
from priming import add_prime_option, prime, primed_note  # benchmarks/ is on sys.path as a script
from memstudy.store import ResultsDB


def config(size: int, batch: int, k: int, args) -> RunConfig:
    techniques = [t for t in args.base.split("+") if t] + ([f"accumulate:{k}"] if k > 1 else [])
    cfg = RunConfig(techniques=techniques, label=f"bench_accumulate {size} k={k}")
    t = cfg.train
    t.image_size, t.batch_size, t.epochs, t.device, t.seed = size, batch, args.epochs, args.device, 0
    t.warmup_steps, t.measure_steps = 2, 2
    t.target_val_loss = args.target
    cfg.data.train_images, cfg.data.val_images = args.train_images, args.val_images
    return cfg


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--batch", type=int, default=8, help="effective batch B")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-images", type=int, default=16)
    p.add_argument("--val-images", type=int, default=4)
    p.add_argument("--target", type=float, default=0.4,
                   help="train.target_val_loss (1 - MS-SSIM) for time_to_target_s")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    p.add_argument("--base", default="amp:bf16", help="techniques every row runs with ('+'-joined; "
                   "'' for float32, whose cuDNN autotuning at batch 8 takes minutes on an H100)")
    add_prime_option(p)
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_accumulate needs a CUDA GPU (or --device cpu for a smoke test)")
    if any(args.batch % k for k in args.ks):
        sys.exit(f"--batch {args.batch} must be divisible by every k in {args.ks}")
    args.out.mkdir(parents=True, exist_ok=True)
    db = ResultsDB(args.out / "accumulate.sqlite")
    prime([config(size, args.batch // k, k, args) for size in args.sizes for k in args.ks],
          args.prime)
    rows = []
    for size in args.sizes:
        for k in args.ks:
            t0 = time.perf_counter()
            rec = execute(config(size, args.batch // k, k, args), db)
            run = {name: v for _, phase, name, v in rec.metrics if phase == "run"}
            last = rec.epochs[-1] if rec.epochs else {}
            rows.append({"size": size, "k": k, "batch": args.batch // k, "status": rec.status,
                         "error": rec.error, "val_loss": last.get("val_loss"), **run})
            print(f"{size} k={k}: {rec.status} {rec.error or ''} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
            print(row_line(rows[-1]), flush=True)
            (args.out / "accumulate.md").write_text(markdown(rows, db, args))
    print(f"wrote {args.out / 'accumulate.md'}")
    return 0


def markdown(rows: list[dict], db: ResultsDB, args) -> str:
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    lines = [f"# Gradient accumulation vs the larger batch ({gpu})", "",
             f"torch {torch.__version__}; effective batch {args.batch}, base set "
             f"`{args.base or 'original (float32)'}`, {args.epochs} "
             f"epochs of {args.train_images} phantoms, validated each epoch on {args.val_images}; "
             f"target val loss {args.target}. Step time: median plain optimizer step. "
             "Peak: allocator (max over measured phases); NVML: device level. "
             + primed_note(args.prime), ""]
    head = ("| px | k | micro-batch | status | peak MB | NVML MB | step s | px/s | energy J | "
            "time to target s | val loss |")
    lines += [head, "|---" * (head.count("|") - 1) + "|"]
    lines += [row_line(r) for r in rows]
    lines += ["", "## Eq. 9: throughput / memory per k", "", render("accumulation", accumulation(db), "md"), ""]
    return "\n".join(lines)


def row_line(r: dict) -> str:
    return (f"| {r['size']} | {r['k']} | {r['batch']} | {r['status']} | "
            f"{_f(r.get('alloc_peak_total_bytes'), MB, 0)} | "
            f"{_f(r.get('nvml_peak_total_bytes'), MB, 0)} | {_f(r.get('step_time_s'), 1, 3)} | "
            f"{_f(r.get('throughput_px_s'), 1, 0)} | {_f(r.get('energy_j'), 1, 1)} | "
            f"{_f(r.get('time_to_target_s'), 1, 1)} | {_f(r.get('val_loss'), 1, 4)} |")


def _f(v, div: float = 1, nd: int = 2) -> str:
    return "-" if v is None else f"{v / div:.{nd}f}"


if __name__ == "__main__":
    raise SystemExit(main())
