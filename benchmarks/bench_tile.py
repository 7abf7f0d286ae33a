"""Exact tiling (`tile`) and tiled validation at large sizes on one GPU.

For each size (default 2048 and 4188, batch 1, phantoms) runs, each in its own process
(`memstudy run`, so every peak is measured from a fresh allocator):
  amp:bf16                              the untiled reference (validation tiled, the default)
  amp:bf16 with train.val_tile_rows=0   the same, validation untiled (validation peak before)
  amp:bf16,tile:T                       for each tile count T in --tiles
  amp:bf16,checkpoint,tile:T            the same with block checkpointing of the untiled levels
and writes per-phase peak MB (allocator, above the phase start), the run's absolute peak, step
time and its ratio to amp:bf16, and how validation ran, into --out/tile.sqlite and
--out/tile.md (GPU named). Each cell trains --steps steps (1 warm-up, the rest measured) and
validates once on one image.

    python benchmarks/bench_tile.py --out gpu-out/results/tile --sizes 2048 --tiles 4,8
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder (tile.sqlite, tile.md); cells "
                   "already in its tile.sqlite are not run again")
    p.add_argument("--sizes", default="2048,4188", help="image sizes (px), comma-separated")
    p.add_argument("--tiles", default="4,8", help="tile counts, comma-separated")
    p.add_argument("--steps", type=int, default=3, help="training steps per cell (1 warm-up)")
    p.add_argument("--timeout", type=float, default=300, help="per-cell timeout (s)")
    p.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint,tile sets")
    return p.parse_args(argv)


def cells(args: argparse.Namespace) -> list[tuple[str, list[str], list[str]]]:
    """(label, techniques, extra --set options) of every cell at one size."""
    tiles = [int(t) for t in args.tiles.split(",") if t]
    out = [("amp:bf16", ["amp:bf16"], []),
           ("amp:bf16 (validation untiled)", ["amp:bf16"], ["train.val_tile_rows=0"])]
    out += [(f"amp:bf16,tile:{t}", ["amp:bf16", f"tile:{t}"], []) for t in tiles]
    if not args.no_checkpoint:
        out += [(f"amp:bf16,checkpoint,tile:{t}", ["amp:bf16", "checkpoint", f"tile:{t}"], [])
                for t in tiles]
    return out


def recorded(db: Path, size: int, label: str) -> bool:
    """A cell already recorded (a carried database is resumed)."""
    if not db.exists():
        return False
    from memstudy.store import ResultsDB

    rows = ResultsDB(db).query("SELECT config_json FROM runs WHERE label = ?", (label,))
    return any(json.loads(r["config_json"])["train"]["image_size"] == size for r in rows)


def run_cell(db: Path, size: int, label: str, techniques: list[str], sets: list[str],
             steps: int, timeout: float) -> None:
    if recorded(db, size, label):
        print(f"{label} at {size} px: already recorded in {db}", flush=True)
        return
    cmd = [sys.executable, "-m", "memstudy", "--db", str(db), "run", "--size", str(size),
           "-t", ",".join(techniques), "--device", "cuda", "--steps", str(steps), "-q",
           "--label", label, "--set", "train.warmup_steps=1",
           "--set", f"train.measure_steps={steps - 1}", "--set", f"data.train_images={steps}",
           "--set", "data.val_images=1", "--set", f"train.epochs={steps}"]
    for s in sets:
        cmd += ["--set", s]
    print("+", " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"cell {label} at {size} px timed out after {timeout:.0f} s", flush=True)


def table(db: Path) -> list[str]:
    from memstudy.store import ResultsDB

    rdb = ResultsDB(db)
    runs = rdb.query("SELECT * FROM runs ORDER BY id")
    gpus = sorted({r["gpu_name"] for r in runs if r["gpu_name"]})
    when = time.strftime('%Y-%m-%d %H:%M')
    lines = [f"GPU: **{', '.join(gpus) or 'unknown'}**; recorded {when}. "
             "Phase MB = allocator peak above the memory held when the phase began; run peak MB "
             "= the largest absolute allocator peak of any phase (weights, gradients and "
             "optimizer state included; CUDA context not included). Step time = median of the "
             "unmetered steps (metered when every step was measured).", "",
             "| size | set | status | forward MB | backward MB | step MB | validation MB | "
             "run peak MB | step s | time / amp:bf16 | validation | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base: dict[int, float] = {}
    for r in runs:
        metrics = {phase: m for (_rank, phase), m in rdb.metrics(r["id"]).items()}
        cfg = json.loads(r["config_json"])
        size, run = cfg["train"]["image_size"], metrics.get("run", {})
        step = run.get("step_time_s") or run.get("metered_step_time_s")
        if r["label"] == "amp:bf16" and step:
            base[size] = step
        peaks = [m["alloc_peak_bytes"] + m.get("alloc_start_bytes", 0)
                 for m in metrics.values() if "alloc_peak_bytes" in m]
        rows = cfg["train"].get("val_tile_rows")
        status = r["status"] + (f" in {r['failed_phase']}" if r["failed_phase"] else "")
        cols = [size, r["label"], status,
                *(_mb(metrics.get(p, {}).get("alloc_peak_bytes"))
                  for p in ("forward", "backward", "step", "validation")),
                _mb(max(peaks) if peaks else None),
                f"{step:.3f}" if step else "-",
                f"{step / base[size]:.2f}" if step and base.get(size) else "-",
                "untiled" if rows == 0 else f"tiled, {rows} rows",
                (r["error"] or "")[:80]]
        lines.append("| " + " | ".join(str(c) for c in cols) + " |")
    return lines


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db = out / "tile.sqlite"
    for size in [int(s) for s in args.sizes.split(",") if s]:
        for label, techniques, sets in cells(args):
            run_cell(db, size, label, techniques, sets, args.steps, args.timeout)
    text = "\n".join(["# Exact tiling: per-phase memory and step time", "", *table(db)]) + "\n"
    (out / "tile.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
