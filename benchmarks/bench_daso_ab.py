"""DASO and AB training against dp on two GPUs (issue 15, parts 3 and 4).

Each variant is one recorded distributed run (world_size 2, memstudy.launch_ranks.run_distributed)
with the same seed, data and steps: `dp`, `daso` (2 emulated nodes of 1 GPU: node_size=1, so
every step's gradient stays on its GPU and the parameters cross once every B steps) and
`dp + ab`. Writes --out/daso_ab.sqlite and --out/daso_ab.md: training time per epoch after the first (rank 0),
mean communication payload per step on rank 0 (daso: `daso_grad_bytes + daso_param_bytes`,
ab: `ab_comm_bytes`, dp: the gradient bytes DDP all-reduces every step, i.e. the trainable
parameters' bytes, counted from the built model), median step time, validation loss / SSIM,
the GPUs' energy (`energy_j` of both ranks, summed) and the time to --target validation loss
(rank 0's `time_to_target_s`; "-" if never reached).

On one host both "nodes" share NVLink: the time saved by DASO's smaller inter-node volume is
not what a real two-node run would show (docs/techniques/daso.md).

    python benchmarks/bench_daso_ab.py --out gpu-out/results/daso [--size 1024] [--images 64]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from memstudy.config import RunConfig
from memstudy.launch_ranks import run_distributed
from memstudy.console import eprint  # a module-level function: spawn pickles it


def config(size: int, images: int, epochs: int, techniques: list[str], device: str,
           target: float) -> RunConfig:
    cfg = RunConfig(techniques=techniques, world_size=2, label="bench_daso_ab")
    cfg.train.target_val_loss = target
    cfg.train.image_size, cfg.train.batch_size, cfg.train.epochs = size, 2, epochs
    cfg.train.warmup_steps, cfg.train.measure_steps = 3, 5
    cfg.train.device = device
    cfg.data.train_images, cfg.data.val_images = images, 4
    return cfg


def comm_per_step(rec, name: str) -> float | None:
    by_step: dict[int, float] = {}
    for rank, step, key, value in rec.series:
        if rank == 0 and key in {"daso": ("daso_grad_bytes", "daso_param_bytes"),
                                 "ab": ("ab_comm_bytes",)}.get(name, ()):
            by_step[step] = by_step.get(step, 0.0) + value
    return statistics.mean(by_step.values()) if by_step else None


def dp_gradient_bytes() -> int:
    from memstudy.models import build_unet
    return sum(p.numel() * p.element_size() for p in build_unet(None, seed=0).parameters()
               if p.requires_grad)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--images", type=int, default=64, help="training images (2 per step)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (gloo)")
    ap.add_argument("--target", type=float, default=0.1,
                    help="train.target_val_loss (1 - MS-SSIM) for time_to_target_s")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db = str(out / "daso_ab.sqlite")
    steps = args.epochs * args.images // 2
    variants = [("dp", ["dp"]),
                ("daso", [f"daso:node_size=1:B=4:S=1:warmup={max(1, steps // 10)}:"
                          f"cooldown={max(1, steps // 10)}"]),
                ("ab", ["dp", f"ab:warmup={steps // 5}:ab_steps={max(2, steps // 10)}"])]
    lines = [f"# DASO and AB vs dp, 2 ranks, {args.size} px, global batch 2, {steps} steps\n",
             "| variant | techniques | status | s / epoch (after the first) | step ms | comm MiB / step (rank 0) | "
             "val loss | val SSIM | energy J (both GPUs) | time to target s | wall s |",
             "|" + "---|" * 11]
    for name, techs in variants:
        t0 = time.time()
        rec = run_distributed(config(args.size, args.images, args.epochs, techs, args.device,
                                     args.target), db, eprint)
        epochs = [e for e in rec.epochs if e.get("rank", 0) == 0]
        run = {k: v for (r, phase, k, v) in rec.metrics if phase == "run" and r == 0}
        comm = dp_gradient_bytes() if name == "dp" else comm_per_step(rec, name)
        # the first epoch holds cuDNN's autotuning and warm-up (as the efficiency score's T)
        timed = epochs[1:] or epochs
        epoch_s = statistics.mean(e["time_s"] for e in timed) if timed else float("nan")
        last = epochs[-1] if epochs else {}
        energy = [v for (r, phase, k, v) in rec.metrics if phase == "run" and r >= 0
                  and k == "energy_j"]  # per rank; absent on the CPU
        to_target = run.get("time_to_target_s")
        lines.append(f"| {name} | {','.join(techs)} | {rec.status} | {epoch_s:.1f} | "
                     f"{run.get('step_time_s', float('nan')) * 1e3:.1f} | "
                     f"{(comm or float('nan')) / 2**20:.1f} | {last.get('val_loss', float('nan')):.4f} | "
                     f"{last.get('val_ssim', float('nan')):.4f} | "
                     f"{f'{sum(energy):.0f}' if energy else '-'} | "
                     f"{'-' if to_target is None else f'{to_target:.1f}'} | {time.time() - t0:.0f} |")
        print(lines[-1], flush=True)
    lines.append("\ndp's communication is the gradient payload DDP all-reduces each step (the "
                 "trainable parameters' bytes); daso and ab are their recorded per-step payloads, "
                 "averaged over all steps of rank 0.")
    (out / "daso_ab.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
