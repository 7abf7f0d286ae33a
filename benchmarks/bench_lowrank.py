"""OIALR (`lowrank`) against full rank on the U-Net at one image size, one GPU (issue 15, part 2).

Each variant is one recorded run (memstudy.runner.execute) with the same seed, data and steps:
`original` (full rank) and `lowrank` at each --betas value. Warm-up covers the full-rank steps,
the conversion and the first base update, so the measured steps are low-rank ones. Writes
--out/lowrank.sqlite and --out/lowrank.md: parameters trainable / held, optimizer-state bytes
and summed rank at the last control step (recorded series), peak allocated memory of the
measured steps, median step time, GPU energy of the training loop (NVML), time to --target
validation loss (2 epochs, validated after each), validation loss / SSIM after the run. Each
row is printed and lowrank.md rewritten as its run ends (a time limit leaves the rows done).
Every variant is first run once unrecorded (benchmarks/priming.py; --no-prime skips it), so the
full-rank row, which runs first, does not include the process's cuDNN autotuning in its energy
and time to target; about two minutes on one H100 with the defaults.

    python benchmarks/bench_lowrank.py --out gpu-out/results/lowrank [--size 1024] [--steps 48]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from memstudy.config import RunConfig
from memstudy.runner import execute
from memstudy.store import ResultsDB
from priming import add_prime_option, prime, primed_note  # benchmarks/ is on sys.path as a script


EPOCHS = 2  # validated after each: time to target


def config(size: int, steps: int, techniques: list[str], warmup: int, args) -> RunConfig:
    cfg = RunConfig(techniques=techniques, label="bench_lowrank")
    cfg.train.image_size, cfg.train.batch_size, cfg.train.epochs = size, 1, EPOCHS
    cfg.train.warmup_steps, cfg.train.measure_steps = warmup, 5
    cfg.train.device, cfg.train.target_val_loss = args.device, args.target
    cfg.data.train_images, cfg.data.val_images = steps // EPOCHS, 4
    return cfg


def mib(b) -> str:
    return f"{b / 2**20:.1f}" if b is not None else "-"


def figures_at(rec, step: int) -> dict[str, float]:
    return {r[2]: r[3] for r in rec.series
            if r[1] == step and r[2].startswith("lowrank_") and ":" not in r[2]}


def last_figures(rec) -> dict[str, float]:
    rows = [r for r in rec.series if r[2].startswith("lowrank_") and ":" not in r[2]]
    if not rows:
        return {}
    last = max(r[1] for r in rows)
    return {r[2]: r[3] for r in rows if r[1] == last} | {"control_step": last}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=48, help="optimizer steps (= training images)")
    ap.add_argument("--betas", default="0.1,0.3")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--target", type=float, default=0.4,
                    help="train.target_val_loss (1 - MS-SSIM) for time_to_target_s")
    add_prime_option(ap)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db = ResultsDB(out / "lowrank.sqlite")
    d, nu = args.steps // 4, max(1, args.steps // 8)
    warmup = d + nu + 1  # measure after the conversion and the first base update
    variants = [("full rank", [])] + [
        (f"lowrank beta={b}", [f"lowrank:d={d}:nu={nu}:alpha=0.25:beta={b}"])
        for b in args.betas.split(",")]
    lines = [f"# OIALR vs full rank ({device_name(args.device)})\n",
             f"{args.size} px, batch 1, {args.steps} steps in {EPOCHS} epochs (d={d}, nu={nu}, "
             f"alpha=0.25), target val loss {args.target}\n",
             "| variant | status | trainable params | held params | optimizer state MiB | rank sum | "
             "peak alloc MiB | step ms | energy J | time to target s | val loss | val SSIM | wall s |",
             "|" + "---|" * 13]
    note = ("\nFull-rank parameter and optimizer-state figures: recorded by the lowrank runs at "
            "step 1, before their conversion (filled in once the first lowrank run has ended). "
            "Other figures: each variant's last control step.\n\n" + primed_note(args.prime))
    prime([config(args.size, args.steps, techs, warmup, args) for _, techs in variants], args.prime,
          say=lambda m: print(m, file=sys.stderr, flush=True))
    records = []
    for name, techs in variants:
        t0 = time.time()
        rec = execute(config(args.size, args.steps, techs, warmup, args), db,
                      progress=lambda m: print(m, file=sys.stderr, flush=True))
        records.append((name, rec, time.time() - t0))
        rows = table_rows(records)
        print(rows[-1], flush=True)
        (out / "lowrank.md").write_text("\n".join(lines + rows) + "\n" + note + "\n")
    return 0


def table_rows(records: list) -> list[str]:
    # The full-rank run's parameter / optimizer figures: what every lowrank run records at
    # step 1, before its conversion (same model, same optimizer, measured from its state).
    reference = next((figures_at(rec, 1) for _, rec, _ in records[1:] if figures_at(rec, 1)), {})
    rows = []
    for name, rec, wall in records:
        run = {k: v for (_, phase, k, v) in rec.metrics if phase == "run"}
        val = rec.epochs[-1] if rec.epochs else {}
        fig = last_figures(rec) if name != "full rank" else reference
        rows.append(
            f"| {name} | {rec.status} | {fig.get('lowrank_trainable_params', 0):,.0f} | "
            f"{fig.get('lowrank_held_params', 0):,.0f} | {mib(fig.get('lowrank_optimizer_state_bytes'))} | "
            f"{fig.get('lowrank_rank_sum', '-')} | {mib(run.get('alloc_peak_total_bytes'))} | "
            f"{run.get('step_time_s', float('nan')) * 1e3:.1f} | {_f(run.get('energy_j'), 1)} | "
            f"{_f(run.get('time_to_target_s'), 1)} | {val.get('val_loss', float('nan')):.4f} | "
            f"{val.get('val_ssim', float('nan')):.4f} | {wall:.0f} |")
    return rows


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"


def _f(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
