"""torch.compile's memory budget and the caching allocator's settings beside checkpoint / offload.

    python benchmarks/bench_compile.py --out benchmarks/results/h100/compile --part compile --sizes 2048
    python benchmarks/bench_compile.py --out benchmarks/results/h100/compile --part compile --sizes 4160
    python benchmarks/bench_compile.py --out benchmarks/results/h100/compile --part allocator

Every configuration is one `memstudy run` in its own process (`memstudy.grid.run_isolated`):
the memory_budget is process-global functorch configuration read when the graphs compile,
compile starts from an empty Dynamo cache, and the allocator settings apply before CUDA
starts, as they must. Each run: 2 warm-up steps (the first compiles), 1 measured, 4 plain,
batch 1, one phantom, no validation, channels_last and cudnn.benchmark on (memstudy's CUDA
defaults), dynamic=False (the shapes never change).
- part compile: amp:bf16+checkpoint (the reference), amp:bf16+compile at memory_budget
  1.0 / 0.5 / 0.2 / 0.1, then amp:bf16 eager and amp:bf16+checkpoint+offload, then compile
  with checkpoint (block regions recomputed inside the compiled backward) at budget 1.0 and 0.5;
- part allocator: amp:bf16+checkpoint(+offload) and amp:bf16 with expandable_segments,
  garbage_collection_threshold and max_split_size_mb.
Compilation reuses Inductor's on-disk caches across the runs (TORCHINDUCTOR_CACHE_DIR, by
default $MEMSTUDY_CACHE/inductor, set here for the child processes when unset): the FX-graph
and AOTAutograd caches key on the graph and on the functorch config, so a different budget or
size compiles its own graphs, while generated kernels whose source is the same (most fusions
between budgets at one size) are not compiled again. The first compile of a size is therefore
slower than the next; each row says whether the cache held anything before it ran ("cold" /
"warm"), and compile_time_s is to be read with that. The two parts share compile.sqlite
(resumable: a configuration recorded by either part is not run again), and <part>-<sizes>.md /
.json hold peak allocated, peak reserved, fragmentation (reserved - allocated), NVML peak,
step time, first-step and compile time, and the peak as a ratio to amp:bf16+checkpoint at the
same size. Each row is printed and both files rewritten as it finishes, so a run cut by a
time limit (gpu.sh sends SIGINT) keeps its rows.

Duration on one H100 (a partial run, 2026-11-22: 20-30 s per eager run, 88 s for the first
compile at 2048 px): part compile about 4-5 min per size, part allocator about 3-4 min per
size; gpu.sh runs each size as its own step.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

REFERENCE = "amp:bf16,checkpoint"
PARTS = {  # the most wanted rows first: a cut run keeps them
    "compile": [
        REFERENCE, "amp:bf16,compile", "amp:bf16,compile:memory_budget=0.5",
        "amp:bf16,compile:memory_budget=0.2", "amp:bf16,compile:memory_budget=0.1",
        "amp:bf16", "amp:bf16,checkpoint,offload",
        "amp:bf16,compile,checkpoint", "amp:bf16,compile:memory_budget=0.5,checkpoint",
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


def config(techniques: str, size: int, steps: int = 7):
    from memstudy.config import RunConfig, split_techniques

    cfg = RunConfig(techniques=split_techniques(techniques), label="bench_compile")
    cfg.train.device, cfg.train.image_size, cfg.train.validate = "cuda", size, False
    cfg.train.warmup_steps, cfg.train.measure_steps = 2, 1
    cfg.train.max_steps = steps
    cfg.train.epochs = steps
    cfg.data.train_images, cfg.data.val_images = 1, 1  # one phantom, reused every step
    return cfg


def inductor_cache() -> Path:
    """Inductor's on-disk cache shared by the runs (their processes inherit the variable)."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        base = os.environ.get("MEMSTUDY_CACHE") or "/tmp/memstudy-cache"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(base) / "inductor")
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def cache_state(cache: Path) -> str:
    return "warm" if cache.is_dir() and any(cache.iterdir()) else "cold"


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
             "NVML peak MB | step ms | first step s | compile s | inductor cache | peak ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    refs = {r["size"]: r["alloc_peak_total_bytes"] for r in rows if r["techniques"] == REFERENCE}
    for r in rows:
        ref = refs.get(r["size"])
        ratio = (f"{r['alloc_peak_total_bytes'] / ref:.2f}"
                 if ref and r.get("alloc_peak_total_bytes") else "-")
        lines.append(f"| {r['techniques']} | {r['size']} | {r['status']} | "
                     f"{_mb(r.get('alloc_peak_total_bytes'))} | {_mb(r.get('reserved_peak_total_bytes'))} | "
                     f"{_mb(r.get('fragmentation_bytes'))} | {_mb(r.get('nvml_peak_total_bytes'))} | "
                     f"{_s(r.get('step_time_s'), 1e3)} | {_s(r.get('first_step_time_s'))} | "
                     f"{_s(r.get('compile_time_s'))} | {r.get('cache', '-')} | {ratio} |")
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
    stem = f"{args.part}-{args.sizes.replace(',', '_')}"
    cache = inductor_cache()
    rows: list[dict] = []
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            for techniques in sets:
                t0, state = time.time(), cache_state(cache)
                row = {"techniques": techniques, "size": size,
                       **run_one(config(techniques, size), db, args.timeout)}
                if "compile" in techniques:
                    row["cache"] = state
                rows.append(row)
                print(f"{techniques} {size} px: {row['status']} peak "
                      f"{_mb(row.get('alloc_peak_total_bytes'))} MB, step "
                      f"{_s(row.get('step_time_s'), 1e3)} ms ({time.time() - t0:.0f} s)", flush=True)
                write(out, stem, args.part, rows, complete=False)
    except KeyboardInterrupt:  # gpu.sh's time limit (SIGINT): keep the rows measured so far
        print(f"cut after {len(rows)} row(s)", flush=True)
        write(out, stem, args.part, rows, complete=False)
        return 1
    print(write(out, stem, args.part, rows, complete=True))
    return 0


def write(out: Path, stem: str, part: str, rows: list[dict], complete: bool) -> str:
    gpu = next((r["gpu"] for r in rows if r.get("gpu")), "GPU unknown")
    (out / f"{stem}.json").write_text(json.dumps({"gpu": gpu, "complete": complete, "rows": rows},
                                                 indent=1))
    text = markdown(part, rows, gpu) + ("" if complete else "\n**Incomplete: cut before every "
                                                           "configuration ran.**\n")
    (out / f"{stem}.md").write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
