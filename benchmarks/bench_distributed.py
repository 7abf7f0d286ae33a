"""The study's multi-GPU tables on two GPUs: Table 4 (data parallel) and Table 6 (model parallel).

Every cell is one `memstudy run` in its own process (an OOM or a crash ends that cell only,
and every cell starts with a fresh CUDA context), recorded in DIR/distributed.sqlite. Then
DIR/distributed.md summarises, per image size and combination: per-rank forward / backward
/ step peak memory (mean over ranks as the study reports, and the maximum, which decides
whether a run fits), device memory from NVML, time per epoch, validation loss, and the
strong-scaling efficiency of DP from 1 to 2 GPUs (same global batch: T1 / (2 * T2)).

    python benchmarks/bench_distributed.py --out benchmarks/results/h200x2/distributed
    python benchmarks/bench_distributed.py --out /tmp/q --sizes 512 --epochs 1 --quick
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memstudy.distributed import RANK_MAX, RANK_MEAN  # noqa: E402
from memstudy.store import ResultsDB  # noqa: E402

# The study's rows; "original" is one GPU, one process (the baseline of both tables).
TABLE_4 = ["original", "dp", "dp,amp", "dp,zero", "dp,zero,amp", "dp,zero,checkpoint",
           "dp,zero,invertible", "dp,zero,amp,checkpoint"]
TABLE_6 = ["mp", "mp,amp", "mp,checkpoint", "mp,invertible", "mp,amp,checkpoint",
           "mp,amp,invertible", "mp,amp,checkpoint,invertible"]
PHASES = ("forward", "backward", "step")
MB = 1e6  # the study's tables are in MB


def world_of(techniques: str) -> int:
    return 1 if techniques == "original" else 2


def recorded(db: Path, techniques: str, size: int) -> bool:
    """A cell already in the database (any final status) is not run again: resumable."""
    return db.exists() and bool(ResultsDB(db).query(
        "SELECT id FROM runs WHERE label = ?", (f"bench_distributed {techniques} {size}",)))


def run_cell(args, techniques: str, size: int, db: Path) -> str:
    if recorded(db, techniques, size):
        print(f"{size:5d} px  {techniques:32s} recorded already", flush=True)
        return "recorded"
    cmd = [sys.executable, "-m", "memstudy", "--db", str(db), "run", "--size", str(size),
           "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
           "--device", args.device, "-t", "none" if techniques == "original" else techniques,
           "--set", f"world_size={world_of(techniques)}",
           "--set", f"data.train_images={args.train_images}",
           "--set", f"data.val_images={args.val_images}",
           "--set", f"train.measure_steps={args.measure_steps}",
           "--set", "train.warmup_steps=2",  # every cell alike; dp needs 2 (DDP buckets)
           "--label", f"bench_distributed {techniques} {size}", "-q"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        status = "ok" if proc.returncode == 0 else f"rc {proc.returncode}: {tail[0][:160]}"
    except subprocess.TimeoutExpired:
        status = f"timeout after {args.timeout} s"
    print(f"{size:5d} px  {techniques:32s} {status}  ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    return status


def epoch_time(epochs: list[dict]) -> float | None:
    """Slowest rank's epoch time, mean over epochs after the first (warm-up) when there are."""
    by_epoch: dict[int, float] = {}
    for e in epochs:
        by_epoch[e["epoch"]] = max(by_epoch.get(e["epoch"], 0.0), e["time_s"])
    times = [t for ep, t in sorted(by_epoch.items()) if ep > 0] or list(by_epoch.values())
    return statistics.fmean(times) if times else None


def summarise(db: ResultsDB) -> list[dict]:
    rows = []
    for run in db.runs():
        if not (run["label"] or "").startswith("bench_distributed"):
            continue
        techniques, size = run["label"].split()[1:3]
        metrics, epochs = db.metrics(run["id"]), db.epochs(run["id"])
        agg_mean = RANK_MEAN if run["world_size"] > 1 else 0
        agg_max = RANK_MAX if run["world_size"] > 1 else 0
        row = {"techniques": techniques, "size": int(size), "status": run["status"],
               "failed_phase": run["failed_phase"], "gpu": run["gpu_name"],
               "world": run["world_size"], "epoch_s": epoch_time(epochs),
               "val_loss": next((e["val_loss"] for e in reversed(epochs) if e["rank"] == 0), None)}
        for phase in PHASES:
            for tag, rank in (("mean", agg_mean), ("max", agg_max)):
                figs = metrics.get((rank, phase), {})  # CPU smoke runs: the tensor meter
                value = figs.get("alloc_peak_bytes", figs.get("tensor_peak_bytes"))
                row[f"{phase}_{tag}"] = None if value is None else value / MB
        nvml = metrics.get((agg_max, "run"), {}).get("nvml_peak_total_bytes")
        row["nvml_max"] = None if nvml is None else nvml / MB
        rows.append(row)
    return rows


def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(rows: list[dict], gpus: str) -> str:
    out = [f"# Distributed techniques on {gpus}", "",
           "Peak allocated memory above the phase's start (MB, 1e6 bytes), per rank: mean over "
           "ranks (the study's figure) / maximum over ranks. Time per epoch: slowest rank.", ""]
    for size in sorted({r["size"] for r in rows}):
        out += [f"## {size} x {size} px", "",
                "| techniques | GPUs | status | forward mean/max | backward mean/max | "
                "step mean/max | NVML peak max | epoch (s) | val loss |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in [r for r in rows if r["size"] == size]:
            status = r["status"] + (f" ({r['failed_phase']})" if r["failed_phase"] else "")
            mem = [f"{fmt(r[f'{p}_mean'])} / {fmt(r[f'{p}_max'])}" for p in PHASES]
            out.append(f"| {r['techniques']} | {r['world']} | {status} | {' | '.join(mem)} | "
                       f"{fmt(r['nvml_max'])} | {fmt(r['epoch_s'], '.2f')} | "
                       f"{fmt(r['val_loss'], '.4f')} |")
        out += ["", scaling_line(rows, size), ""]
    return "\n".join(out)


def scaling_line(rows: list[dict], size: int) -> str:
    one = next((r for r in rows if r["size"] == size and r["techniques"] == "original"), None)
    two = next((r for r in rows if r["size"] == size and r["techniques"] == "dp"), None)
    if not (one and two and one["epoch_s"] and two["epoch_s"]):
        return "DP scaling efficiency 1 -> 2 GPUs: not measured (a run failed or is missing)."
    eff = one["epoch_s"] / (2 * two["epoch_s"])
    return (f"DP scaling efficiency 1 -> 2 GPUs (same global batch): {eff:.0%} "
            f"({one['epoch_s']:.2f} s -> {two['epoch_s']:.2f} s per epoch).")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for distributed.sqlite and .md")
    p.add_argument("--sizes", default="512,1024,2048")
    p.add_argument("--batch-size", type=int, default=2, help="global batch (dp: 1 per GPU)")
    # 3 epochs x 16 phantoms = 24 steps at global batch 2. Fewer is not a validation figure:
    # for the first ~20 steps BatchNorm's running statistics lag the batch statistics, eval-mode
    # activations are 10-100x the training-mode ones, the validation loss stalls or rises, and
    # in float16 they overflow at 2048 px (docs/metrics.md, "Validation early in training").
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-images", type=int, default=16)
    p.add_argument("--val-images", type=int, default=2)
    p.add_argument("--measure-steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800, help="per cell, seconds")
    p.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    p.add_argument("--quick", action="store_true", help="only original, dp, dp,zero, mp")
    p.add_argument("--summary-only", action="store_true", help="re-read the DB, run nothing")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db_path = out / "distributed.sqlite"
    cells = ["original", "dp", "dp,zero", "mp"] if args.quick else TABLE_4 + TABLE_6
    if not args.summary_only:
        for size in [int(s) for s in args.sizes.split(",")]:
            for techniques in cells:
                run_cell(args, techniques, size, db_path)
    rows = summarise(ResultsDB(db_path))
    gpus = ", ".join(sorted({r["gpu"] for r in rows if r["gpu"]})) or "(no GPU recorded)"
    text = markdown(rows, gpus)
    (out / "distributed.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
