"""Foundation benchmark (GPU): `memstudy run` at 512, 1024 and 2048 px, float32, batch 1.

Each size runs in its own process (a fresh CUDA context and allocator), once with the default
meters (allocator + NVML) and once at 512 px with the tensor meter on as well, so the
allocator can be checked against the independent tensor-level count. Writes the runs into
--db and a Markdown summary (per-phase table, allocator vs NVML, meter overhead) to --md.

    python benchmarks/bench_foundation.py --db out/gpu.sqlite --md out/foundation.md
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from memstudy.store import ResultsDB
from memstudy.byte_sizes import mb

SIZES = (512, 1024, 2048)
COMMON = ["--batch-size", "1", "--epochs", "1", "--device", "cuda", "-q",
          "--set", "data.train_images=12", "--set", "data.val_images=2",
          "--set", "train.warmup_steps=2", "--set", "train.measure_steps=3"]


def run(db: str, size: int, label: str, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "memstudy", "--db", db, "run", "--size", str(size),
           "--label", label, *COMMON, *extra]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False)


def fmt(x: float | None, scale=mb) -> str:
    return "-" if x is None else f"{scale(x):.1f}"


def summary(db: ResultsDB) -> str:
    rows = db.query("SELECT * FROM runs WHERE label LIKE 'foundation%' ORDER BY image_size, id")
    if not rows:
        return "no runs recorded\n"
    env = json.loads(rows[0]["env_json"])
    out = [f"GPU: **{env.get('gpu_name')}** ({mb(env.get('gpu_total_bytes') or 0):.0f} MB), driver "
           f"{env.get('driver')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN "
           f"{env.get('cudnn')}; float32 (TF32 off), batch 1, Adam, seed 0.\n",
           "### Per-phase memory (MB) and time (ms)\n",
           "| size | label | status | phase | alloc peak | alloc held | saved | reserved peak | NVML peak | NVML +Δ | tensor-meter peak | time |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    overhead = ["### Meter overhead and step time\n",
                "| size | label | step time plain (ms) | step time metered (ms) | overhead | Mpx/s | allocator peak (MB) | NVML peak (MB) | NVML - reserved (MB, ≈ CUDA context + workspaces) |",
                "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = db.metrics(r["id"])
        for phase in ("forward", "backward", "step", "validation"):
            p = m.get((0, phase))
            if not p or "time_s" not in p:
                continue
            out.append(f"| {r['image_size']} | {r['label']} | {r['status']} | {phase} | "
                       f"{fmt(p.get('alloc_peak_bytes'))} | {fmt(p.get('alloc_held_bytes'))} | "
                       f"{fmt(p.get('saved_bytes'))} | {fmt(p.get('reserved_peak_bytes'))} | "
                       f"{fmt(p.get('nvml_peak_bytes'))} | {fmt(p.get('nvml_delta_bytes'))} | "
                       f"{fmt(p.get('tensor_peak_bytes'))} | {p['time_s'] * 1e3:.1f} |")
        run_m = m.get((0, "run"), {})
        res = max((p.get("reserved_peak_bytes", 0) for (_, ph), p in m.items() if ph != "run"), default=0)
        if "step_time_s" in run_m:
            ovh = run_m.get("meter_overhead")
            overhead.append(
                f"| {r['image_size']} | {r['label']} | {run_m['step_time_s'] * 1e3:.1f} | "
                f"{run_m.get('metered_step_time_s', 0) * 1e3:.1f} | "
                f"{'-' if ovh is None else f'{ovh:+.1%}'} | {run_m['throughput_px_s'] / 1e6:.1f} | "
                f"{fmt(run_m.get('alloc_peak_total_bytes'))} | {fmt(run_m.get('nvml_peak_total_bytes'))} | "
                f"{fmt((run_m.get('nvml_peak_total_bytes') or 0) - res)} |")
        if r["status"] != "ok":
            out.append(f"| {r['image_size']} | {r['label']} | {r['status']} | {r['failed_phase']} | {r['error']} |")
    return "\n".join(out + [""] + overhead) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--db", required=True)
    ap.add_argument("--md", required=True)
    args = ap.parse_args()
    for size in SIZES:
        run(args.db, size, "foundation", [])
    run(args.db, 512, "foundation+tensor-meter", ["--set", "meter.tensor='on'"])
    text = summary(ResultsDB(args.db))
    with open(args.md, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
