"""torch.compile's memory budget and the caching allocator's settings beside checkpoint / offload.

    python benchmarks/bench_compile.py --out benchmarks/results/h100/compile --part compile --sizes 2048
    python benchmarks/bench_compile.py --out benchmarks/results/h100/compile --part compile --sizes 4160
    python benchmarks/bench_compile.py --out benchmarks/results/h100/compile --part allocator

Every configuration is one `memstudy run` in its own process (`memstudy.grid.run_isolated`):
compile starts from an empty Dynamo cache and the allocator settings apply before CUDA starts,
as they must. Each run: 3 warm-up steps (the first compiles), 2 measured, 5 plain, batch 1,
no validation, channels_last and cudnn.benchmark on (memstudy's CUDA defaults).
- part compile: amp:bf16 eager, amp:bf16+checkpoint(+offload) and amp:bf16+compile at
  memory_budget 1.0 / 0.5 / 0.2 / 0.1 (compile refuses checkpoint: the budget is its way to
  recompute);
- part allocator: amp:bf16+checkpoint(+offload) and amp:bf16 with expandable_segments,
  garbage_collection_threshold and max_split_size_mb.
Writes compile.sqlite (resumable: recorded configurations are not run again), and
<part>.md / <part>.json with peak allocated, peak reserved, fragmentation (reserved -
allocated), NVML peak, step time, first-step and compile time, and the peak as a ratio to
amp:bf16+checkpoint at the same size.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

REFERENCE = "amp:bf16,checkpoint"
PARTS = {
    "compile": [
        "amp:bf16", "amp:bf16,checkpoint", "amp:bf16,checkpoint,offload",
        "amp:bf16,compile", "amp:bf16,compile:memory_budget=0.5",
        "amp:bf16,compile:memory_budget=0.2", "amp:bf16,compile:memory_budget=0.1",
    ],
    "allocator": [
        "amp:bf16,checkpoint", "amp:bf16,checkpoint,offload",
        "amp:bf16,checkpoint,allocator:expandable_segments=true",
        "amp:bf16,checkpoint,offload,allocator:expandable_segments=true",
        "amp:bf16,checkpoint,offload,allocator:garbage_collection_threshold=0.6",
        "amp:bf16,checkpoint,offload,allocator:max_split_size_mb=256",
        "amp:bf16", "amp:bf16,allocator:expandable_segments=true",
    ],
}
RUN_FIGURES = ("alloc_peak_total_bytes", "reserved_peak_total_bytes", "fragmentation_bytes",
               "nvml_peak_total_bytes", "step_time_s", "first_step_time_s", "compile_time_s")


def config(techniques: str, size: int, steps: int = 10):
    from memstudy.config import RunConfig, split_techniques

    cfg = RunConfig(techniques=split_techniques(techniques), label="bench_compile")
    cfg.train.device, cfg.train.image_size, cfg.train.validate = "cuda", size, False
    cfg.train.warmup_steps, cfg.train.measure_steps = 3, 2
    cfg.train.max_steps = steps
    cfg.train.epochs = steps
    cfg.data.train_images, cfg.data.val_images = 2, 1  # phantoms reused over the epochs
    return cfg


def run_one(cfg, db: Path, timeout_s: float) -> dict:
    from memstudy.grid import config_hash, run_isolated
    from memstudy.store import ResultsDB

    key = config_hash(copy.deepcopy(cfg))
    store = ResultsDB(db)
    if key not in store.recorded_hashes():
        run_isolated(cfg, db, timeout_s)
    rows = store.query("SELECT id, status, failed_phase, error, env_json FROM runs "
                       "WHERE config_hash = ? ORDER BY id DESC LIMIT 1", (key,))
    if not rows:
        return {"status": "not recorded (crashed or killed)"}
    run = rows[0]
    figures = {r["name"]: r["value"] for r in store.query(
        "SELECT name, value FROM metrics WHERE run_id = ? AND phase = 'run' AND rank = 0",
        (run["id"],))}
    env = json.loads(run["env_json"])
    out = {"status": run["status"] + (f" in {run['failed_phase']}" if run["failed_phase"] else ""),
           "error": run["error"], "gpu": env.get("gpu_name"),
           "allocator_settings": env.get("allocator_settings")}
    out.update({k: figures.get(k) for k in RUN_FIGURES})
    return out


def _mb(x):
    return "-" if x is None else f"{x / 2**20:.0f}"


def _s(x, scale=1.0, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x * scale)


def markdown(part: str, rows: list[dict], gpu: str) -> str:
    lines = [f"# {part}: peak memory and step time ({gpu})", "",
             f"benchmarks/bench_compile.py --part {part}; batch 1, bf16 autocast, channels_last, "
             "cudnn.benchmark; each run in its own process; recorded "
             f"{time.strftime('%Y-%m-%d %H:%M')}. MB = MiB. fragmentation = peak reserved - peak "
             f"allocated (docs/metrics.md). Ratio = peak allocated / {REFERENCE}'s at that size.", "",
             "| techniques | px | status | peak alloc MB | peak reserved MB | fragmentation MB | "
             "NVML peak MB | step ms | first step s | compile s | peak ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    refs = {r["size"]: r["alloc_peak_total_bytes"] for r in rows if r["techniques"] == REFERENCE}
    for r in rows:
        ref = refs.get(r["size"])
        ratio = (f"{r['alloc_peak_total_bytes'] / ref:.2f}"
                 if ref and r.get("alloc_peak_total_bytes") else "-")
        lines.append(f"| {r['techniques']} | {r['size']} | {r['status']} | "
                     f"{_mb(r.get('alloc_peak_total_bytes'))} | {_mb(r.get('reserved_peak_total_bytes'))} | "
                     f"{_mb(r.get('fragmentation_bytes'))} | {_mb(r.get('nvml_peak_total_bytes'))} | "
                     f"{_s(r.get('step_time_s'), 1e3)} | {_s(r.get('first_step_time_s'))} | "
                     f"{_s(r.get('compile_time_s'))} | {ratio} |")
    failed = [r for r in rows if r["status"] != "ok" and r.get("error")]
    for r in failed:
        lines.append(f"\n- {r['techniques']} {r['size']} px: {r['error'][:300]}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--part", choices=sorted(PARTS), required=True)
    p.add_argument("--sizes", default="2048,4160")
    p.add_argument("--sets", help="semicolon-separated technique sets instead of the part's")
    p.add_argument("--timeout", type=float, default=300, help="per-run timeout (s)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db = out / "compile.sqlite"
    sets = args.sets.split(";") if args.sets else PARTS[args.part]
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for techniques in sets:
            t0 = time.time()
            row = {"techniques": techniques, "size": size, **run_one(config(techniques, size), db,
                                                                     args.timeout)}
            rows.append(row)
            print(f"{techniques} {size} px: {row['status']} peak {_mb(row.get('alloc_peak_total_bytes'))} "
                  f"MB, step {_s(row.get('step_time_s'), 1e3)} ms ({time.time() - t0:.0f} s)", flush=True)
    gpu = next((r["gpu"] for r in rows if r.get("gpu")), "GPU unknown")
    stem = f"{args.part}-{args.sizes.replace(',', '_')}"
    (out / f"{stem}.json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))
    text = markdown(args.part, rows, gpu)
    (out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
