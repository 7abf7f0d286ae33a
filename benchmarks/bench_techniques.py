"""Single-GPU techniques benchmark (issue 3): the study's Table 2 / Fig. 2 and Table 1.

Runs two grids, each cell in its own process (`memstudy grid`): the memory grid
(benchmarks/specs/techniques-memory.toml: 14 technique sets x 512 / 1024 / 2048 px) into
--db, and the loss grid (techniques-loss.toml: the same 6 epochs for every set at 512 px)
into --loss-db. Writes a Markdown summary: per-phase peak MB, time per step, each as a ratio
to Original beside the study's own Table 2 ratios, and the loss table.

    python benchmarks/bench_techniques.py --db out/techniques.sqlite --loss-db out/loss.sqlite --md out/techniques.md
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from memstudy.report.tables import losses, phase_memory
from memstudy.store import ResultsDB

SPECS = Path(__file__).parent / "specs"
# The study's Table 2 (RTX 2060, 512 px, MB): forward / backward of each technique set.
STUDY_TABLE2 = {"original": (757.76, 440.32), "amp:fp16": (481.28, 102.40),
                "quantization": (614.40, 450.56), "checkpoint:block": (286.72, 655.36),
                "invertible": (696.32, 389.12), "amp:fp16,checkpoint": (266.24, 194.56),
                "checkpoint,invertible": (337.92, 563.20),
                "amp:fp16,checkpoint,invertible": (317.44, 286.72)}


def grid(db: str, spec: str, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "memstudy", "--db", db, "grid", str(SPECS / spec), *extra]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False)


def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def memory_section(db: str) -> list[str]:
    rows = phase_memory(db)
    base = {r["image_size"]: r for r in rows if r["name"] == "original"}
    out = []
    for size in sorted({r["image_size"] for r in rows}):
        b = base.get(size, {})
        out += [f"\n#### {size} x {size} px\n",
                "| technique set | status | forward MB | backward MB | step MB | peak MB | step ms | fwd ratio | bwd ratio | peak ratio | time ratio | study fwd / bwd ratio (512 px) |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["image_size"] == size):
            ratio = lambda k: (r[k] / b[k]) if r.get(k) is not None and b.get(k) else None  # noqa: E731
            study = STUDY_TABLE2.get(r["name"].replace("checkpoint:block", "checkpoint")) or STUDY_TABLE2.get(r["name"])
            ref = STUDY_TABLE2["original"]
            study_txt = f"{study[0] / ref[0]:.2f} / {study[1] / ref[1]:.2f}" if study else "-"
            step_ms = r["step_time_s"] * 1e3 if r.get("step_time_s") else None
            out.append(f"| {r['name']} | {r['status']} | {_f(r['forward_mb'])} | {_f(r['backward_mb'])} | "
                       f"{_f(r['step_mb'])} | {_f(r['peak_total_mb'])} | {_f(step_ms)} | "
                       f"{_f(ratio('forward_mb'), '{:.2f}')} | {_f(ratio('backward_mb'), '{:.2f}')} | "
                       f"{_f(ratio('peak_total_mb'), '{:.2f}')} | {_f(ratio('step_time_s'), '{:.2f}')} | {study_txt} |")
    return out


def loss_section(db: str) -> list[str]:
    out = ["\n### Loss after the same short training (Table 1)\n",
           "| technique set | epochs | train loss | val loss (1 - MS-SSIM) | val SSIM | val PSNR dB |",
           "|---|---|---|---|---|---|"]
    for r in losses(db):
        out.append(f"| {r['name']} | {r['epochs']} | {_f(r['train_loss'], '{:.4f}')} | "
                   f"{_f(r['val_loss'], '{:.4f}')} | {_f(r['val_ssim'], '{:.4f}')} | {_f(r['val_psnr'], '{:.2f}')} |")
    failed = ResultsDB(db).query("SELECT name, status, failed_phase, error FROM runs WHERE status != 'ok'")
    for f in failed:
        out.append(f"| {f['name']} | {f['status']} in {f['failed_phase']} | {f['error'][:120]} | | | |")
    return out


def header(db: str) -> str:
    runs = ResultsDB(db).runs()
    env = json.loads(runs[0]["env_json"]) if runs else {}
    return (f"GPU: **{env.get('gpu_name')}**, driver {env.get('driver')}, torch {env.get('torch')}, "
            f"CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}. Peak MB = allocator peak above the "
            "memory held when the phase began (docs/metrics.md); peak = the run's allocator peak "
            "including weights and optimizer state. Ratios are to Original at the same size.\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--db", required=True)
    ap.add_argument("--loss-db", required=True)
    ap.add_argument("--md", required=True)
    ap.add_argument("--skip", choices=["memory", "loss"], action="append", default=[])
    args = ap.parse_args()
    if "memory" not in args.skip:
        grid(args.db, "techniques-memory.toml", ["-q"])
    if "loss" not in args.skip:
        grid(args.loss_db, "techniques-loss.toml", ["-q"])
    parts = [header(args.db), "### Per-phase peak memory and time per step (Table 2, Fig. 2)",
             *memory_section(args.db)]
    if Path(args.loss_db).exists():
        parts += loss_section(args.loss_db)
    text = "\n".join(parts) + "\n"
    Path(args.md).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
