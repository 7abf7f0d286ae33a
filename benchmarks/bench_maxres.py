"""Largest trainable square image under an 8 GiB budget on one GPU (issue 4), predicted and found.

    python benchmarks/bench_maxres.py --out benchmarks/results/h200/technique-grid   # GPU 0, 8GiB
    python benchmarks/bench_maxres.py --out /tmp/mx --gpu 1 --budget 6GiB

For Original, AMP bf16, Chkp, AMP+Chkp, AMP+Chkp+Mom (invertible residuals, the study's
Momentum-Net) and a few further combinations, `memstudy.maxres` predicts the largest size
from the peak memory at --fit-sizes (a + b * pixels, per phase) and then searches it on the
64 px grid, each probe a 3-step training run (1 warm-up, 2 measured) in its own process
under the emulated budget (docs/budget.md). The best combination found is the one with the
largest size (ties: the fastest step). Writes into --out:
  gpu.sqlite   every probe (runs) and the maxres table; the notebooks read it by default
  maxres.md    the table, with the GPU named
  report.html  the offline HTML report of the database
A rerun reads back probes already recorded (same config hash) instead of rerunning them.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

STUDY_SETS = {  # the study's names -> technique sets
    "Original": [],
    "AMP bf16": ["amp:bf16"],
    "Chkp": ["checkpoint"],
    "AMP+Chkp": ["amp:bf16", "checkpoint"],
    "AMP+Chkp+Mom": ["amp:bf16", "checkpoint", "invertible"],
}
CANDIDATES = [  # further combinations searched for the best one (chosen from the H200
    # technique grid: sqrt checkpointing and offload gave the lowest peaks there)
    ["amp:bf16", "checkpoint:sqrt"],
    ["amp:bf16", "checkpoint", "offload"],
    # issue 11: torch.compile with a memory budget (recomputation chosen by the partitioner)
    # and the allocator's expandable segments on the lowest-peak set
    ["amp:bf16", "compile:memory_budget=0.5"],
    ["amp:bf16", "compile:memory_budget=0.2"],
    ["amp:bf16", "checkpoint", "offload", "allocator:expandable_segments=true"],
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder (database, maxres.md, report.html)")
    p.add_argument("--budget", default="8GiB", help="emulated device memory (CUDA context included)")
    p.add_argument("--gpu", default="0", help="CUDA_VISIBLE_DEVICES entry of the GPU to use")
    p.add_argument("--fit-sizes", default="512,768,1024", help="sizes measured for the prediction")
    p.add_argument("--max-size", type=int, default=8192, help="largest size probed (px)")
    p.add_argument("--steps", type=int, default=3, help="training steps per probe")
    p.add_argument("--timeout", type=float, default=900, help="per-probe timeout (s)")
    p.add_argument("--db-name", default="gpu.sqlite")
    return p.parse_args(argv)


def template(args: argparse.Namespace):
    from memstudy.config import RunConfig

    cfg = RunConfig(budget=args.budget)
    cfg.train.device = "cuda"
    cfg.train.max_steps = args.steps
    cfg.train.warmup_steps = 1
    cfg.train.measure_steps = max(args.steps - 1, 1)
    cfg.train.validate = False
    return cfg


def valid_sets(cfg, sets: list[list[str]]) -> list[list[str]]:
    """Sets that can run here (a technique not yet written is reported and skipped)."""
    from memstudy.errors import ConfigError
    from memstudy.maxres import probe_config
    from memstudy.techniques.compose import make_plan

    keep = []
    for techniques in sets:
        try:
            make_plan(probe_config(cfg, techniques, 1024))
            keep.append(techniques)
        except ConfigError as exc:
            print(f"skipping {'+'.join(techniques)}: {exc}", file=sys.stderr)
    return keep


def write_outputs(out: Path, db: Path, results, budget: str) -> None:
    from memstudy.maxres import maxres_table
    from memstudy.report import build_report, largest_size

    rows = largest_size(db)
    gpus = sorted({r["device"] for r in rows if r["device"]})
    done = [r for r in results if r.found_px]
    best = max(done, key=lambda r: (r.found_px, -(r.at_found().step_time_s or 0))) if done else None
    lines = [f"# Largest trainable size under {budget}", "",
             f"GPU: {', '.join(gpus) or 'unknown'}; budget emulated as docs/budget.md describes; "
             f"recorded {time.strftime('%Y-%m-%d %H:%M')}.", "", "```", maxres_table(results), "```",
             "", f"Best combination found: {best.name} at {best.found_px} px" if best else
             "No combination trained at the smallest size."]
    (out / "maxres.md").write_text("\n".join(lines) + "\n")
    (out / "report.html").write_text(build_report(db, "html", budget=budget))
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu  # before torch sees the GPUs; probes inherit it
    from memstudy.maxres import search_all
    from memstudy.console import eprint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db = out / args.db_name
    cfg = template(args)
    sets = valid_sets(cfg, [*STUDY_SETS.values(), *CANDIDATES])
    fit = [int(s) for s in args.fit_sizes.split(",")]
    results = search_all(copy.deepcopy(cfg), sets, db, fit_sizes=fit, max_size=args.max_size,
                         timeout_s=args.timeout, progress=eprint)
    write_outputs(out, db, results, args.budget)
    return 0 if all(r.error is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
