"""Tri-Accel on the U-Net ([Tri-Accel] (docs/references.md) Tables 1 and 2, adapted): GPU benchmark, run by the lead.

    python benchmarks/bench_triaccel.py --out benchmarks/results/h100/triaccel [--sizes 1024 2048]
        [--parts stats ablation] [--tri-extra ":tau_low=1e-7:tau_high=1e-3"]

Part `stats` (triaccel_stats.md): the per-unit gradient statistics, median of 50 launches
(CUDA events) on the U-Net's real gradients at --stats-size px: `loop` (one torch.var_mean per
unit over its concatenated .grad tensors), `cat+kernel` (torch.cat of every .grad + the Triton
kernel: the old path), `flat` (the kernel on the flat gradient buffer, read in place, plus the
per-step memset of the buffer), then whole training steps of tri_accel:precision=on (curvature
and elastic off) with grad_layout=flat / separate and stats=triton / torch: median plain step
time and allocator peak, i.e. the statistics end to end, in place or gathered.

Part `ablation`:

Configurations (cumulative, as the paper's ablation):
  fp32        plain float32 (the paper's "FP32 baseline" / "Standard Training")
  amp         static AMP, amp:fp16 (autocast float16 + loss scaling) for every layer
  +batch      amp:fp16 + tri_accel elastic batch only (precision and curvature off)
  +precision  tri_accel elastic batch + per-unit adaptive precision (curvature off)
  tri_accel   all three parts
--tri-extra appends options to every tri_accel spec (e.g. thresholds found by
`memstudy tune benchmarks/specs/tune-triaccel.toml`); --tuned DB appends the best recorded
trial's tau_low / tau_high / tau_curv of that search (memstudy.tune.results.best_trials over
--tune-spec in DB), named with its run id in triaccel.md (gpu.sh step triaccel-tuned). Every run: synthetic phantoms, batch 1 to start, validation in float32, the same epochs, a budget of 16 GiB (the
paper's T4/P100 cards, emulated by memstudy's allocator cap), every step after one warm-up
step measured so the peak covers the whole run. Writes triaccel.sqlite and triaccel.md
into --out: peak memory, time per epoch, validation quality, the efficiency score
(memstudy.techniques.tri_accel.score.run_efficiency, defined in docs/triaccel.md), GPU energy of the
training loop (NVML) and the time to --target validation loss. Every row is first run once
unrecorded (benchmarks/priming.py; --no-prime skips it), so that no row's energy and time to
target include the cuDNN autotuning of its shapes. Every row is printed and
triaccel.md rewritten as its run ends, so a time limit leaves the rows done. Defaults:
a few minutes on one H100 (the stats part ~30 s, then 10 runs of 2 epochs x 24 phantoms).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from memstudy.config import RunConfig
from memstudy.techniques.tri_accel.grad_stats import flatten, make_layout, segment_stats
from memstudy.models import build_unet
from memstudy.techniques.tri_accel.control_units import unet_units
from memstudy.techniques.tri_accel.flat_grads import FlatGradients
from memstudy.runner import execute
from memstudy.store import ResultsDB
from memstudy.techniques.tri_accel.score import run_efficiency
from memstudy.byte_sizes import MB
from priming import add_prime_option, prime, primed_note  # benchmarks/ is on sys.path as a script
from cuda_timing import median_ms  # benchmarks/ is on sys.path when run as a script

TRI = "tri_accel:t_ctrl=2:t_curv=4:b_curv=1:curv_crop=512:power_iters=3:max_batch=8"
CONFIGS = {
    "fp32": [],
    "amp": ["amp:fp16"],
    "+batch": ["amp:fp16", f"{TRI}:precision=off:curvature=off"],
    "+precision": [f"{TRI}:curvature=off"],
    "tri_accel": [TRI],
}


def config(size: int, techniques: list[str], args) -> RunConfig:
    cfg = RunConfig(techniques=list(techniques), budget=args.budget, label=f"bench_triaccel {size}")
    t = cfg.train
    t.image_size, t.batch_size, t.epochs, t.device, t.seed = size, 1, args.epochs, "cuda", 0
    t.warmup_steps, t.measure_steps = 1, 10_000  # every step measured: a whole-run peak
    t.target_val_loss = args.target
    # quality of the weights in every row alike: a float16 eval forward overflows while
    # BatchNorm's running statistics lag (the elastic batch leaves few steps per epoch)
    t.val_precision = "float32"
    cfg.data.train_images, cfg.data.val_images = args.train_images, 2
    return cfg


def ablation_techniques(name: str, args) -> list[str]:
    """An ablation row's technique specs, --tri-extra appended to the tri_accel one."""
    return [t + args.tri_extra if t.startswith("tri_accel") else t for t in CONFIGS[name]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--epochs", type=int, default=2)
    # 24, not 8: with the elastic batch at 2-4 an epoch of 8 was ~4 steps (H100, 2026-11-23)
    p.add_argument("--train-images", type=int, default=24)
    p.add_argument("--target", type=float, default=0.4,
                   help="train.target_val_loss (1 - MS-SSIM) for time_to_target_s")
    p.add_argument("--budget", default="16GiB")
    p.add_argument("--parts", nargs="+", choices=("stats", "ablation"), default=["stats", "ablation"])
    p.add_argument("--stats-size", type=int, default=1024)
    p.add_argument("--configs", nargs="+", choices=tuple(CONFIGS), default=list(CONFIGS),
                   help="ablation rows to run (default: all)")
    p.add_argument("--tri-extra", default="", help="options appended to every tri_accel spec")
    p.add_argument("--tuned", type=Path, help="a `memstudy tune` database: append its best "
                   "trial's settings to every tri_accel spec")
    p.add_argument("--tune-spec", default="benchmarks/specs/tune-triaccel.toml")
    add_prime_option(p)
    args = p.parse_args()
    args.source = None
    if args.tuned is not None:
        args.tri_extra, args.source = args.tri_extra + tuned_options(args), str(args.tuned)
    if not torch.cuda.is_available():
        sys.exit("bench_triaccel needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    db = ResultsDB(args.out / "triaccel.sqlite")
    if "stats" in args.parts:
        (args.out / "triaccel_stats.md").write_text(stats_part(db, args))
        print((args.out / "triaccel_stats.md").read_text(), flush=True)
    if "ablation" not in args.parts:
        return 0
    prime([config(size, ablation_techniques(name, args), args)
           for size in args.sizes for name in args.configs], args.prime)
    rows = []
    for size in args.sizes:
        for name in args.configs:
            t0 = time.perf_counter()
            rec = execute(config(size, ablation_techniques(name, args), args), db)
            run_id = db.runs()[-1]["id"]
            eff = run_efficiency(db, run_id) if rec.status == "ok" else {}
            batches = [v for _, _, n, v in rec.series if n == "batch_size"]
            share = [v for _, _, n, v in rec.series if n == "tri/curvature_share"]
            run = {n: v for _, ph, n, v in rec.metrics if ph == "run"}
            rows.append({"size": size, "name": name, "status": rec.status, "run_id": run_id,
                         "max_batch": max(batches) if batches else None,
                         "curvature_share": share[-1] if share else None,
                         "energy_j": run.get("energy_j"),
                         "time_to_target_s": run.get("time_to_target_s"), **eff})
            print(f"{size} {name}: {rec.status} ({time.perf_counter() - t0:.0f} s)", flush=True)
            print(row_line(rows[-1], None), flush=True)
            (args.out / "triaccel.md").write_text(markdown(rows, torch.cuda.get_device_name(), args))
    print(f"wrote {args.out / 'triaccel.md'}")
    return 0


def tuned_options(args) -> str:
    """':tau_low=..:tau_high=..:tau_curv=..' of the best recorded trial of --tune-spec in --tuned."""
    from memstudy.tune import load_tune_spec
    from memstudy.tune.results import best_trials

    if not args.tuned.is_file():
        sys.exit(f"--tuned {args.tuned}: no such database (run gpu.sh step tune-triaccel first)")
    best = best_trials(load_tune_spec(args.tune_spec), ResultsDB(args.tuned))
    if not best or best[0]["status"] != "ok":
        sys.exit(f"--tuned {args.tuned}: no successful recorded trial of {args.tune_spec}")
    args.tuned_run = best[0]["run_id"]
    extra = "".join(f":{key.partition('.')[2]}={value}" for key, value in best[0]["params"].items()
                    if key.startswith("tri_accel."))
    print(f"tuned thresholds from run {args.tuned_run} of {args.tuned}: {extra}", flush=True)
    return extra


def timed(fn, repeat: int = 50) -> float:
    """Median milliseconds of fn() by CUDA events, after five warm-up calls."""
    return median_ms(fn, repeat)


def stats_part(db: ResultsDB, args) -> str:
    gpu = torch.cuda.get_device_name()
    model = build_unet().cuda()
    units = [u.parameters() for u in unet_units(model)]
    flat = FlatGradients(units, torch.device("cuda"))
    x = torch.rand(1, 1, args.stats_size, args.stats_size, device="cuda")
    flat.attach()
    model(x).square().mean().backward()  # real gradients, in the flat buffer
    grads = [[p.grad for p in unit] for unit in units]
    layout = make_layout(flat.sizes, "cuda")

    def flat_step():
        flat.buffer.zero_()  # what the flat layout adds per step
        segment_stats(flat.buffer, layout)

    ms = {"loop": timed(lambda: [torch.var_mean(flatten(g), correction=0) for g in grads]),
          "cat+kernel": timed(lambda: segment_stats(flatten([t for g in grads for t in g]), layout)),
          "flat (kernel + memset)": timed(flat_step),
          "flat (kernel alone)": timed(lambda: segment_stats(flat.buffer, layout))}
    lines = [f"# Tri-Accel gradient statistics ({gpu})", "",
             f"torch {torch.__version__}; {sum(flat.sizes) / 1e6:.1f} M gradient elements in "
             f"{len(flat.sizes)} units; median of 50 (ms, CUDA events)", "",
             "| path | ms | vs loop |", "|---|---|---|"]
    lines += [f"| {k} | {v:.3f} | {ms['loop'] / v:.2f}x |" for k, v in ms.items()]
    lines += ["", f"## Whole steps at {args.stats_size} px (tri_accel precision only, batch 1, "
              "plain-step median)", "", "| grad_layout | stats | status | step ms | peak MB |",
              "|---|---|---|---|---|"]
    for layout_name, stats in (("flat", "triton"), ("separate", "triton"), ("separate", "torch")):
        spec = f"tri_accel:curvature=off:elastic=off:grad_layout={layout_name}:stats={stats}"
        cfg = config(args.stats_size, [spec], args)
        cfg.train.warmup_steps, cfg.train.measure_steps, cfg.train.validate = 3, 2, False
        cfg.train.target_val_loss = None  # no validation in these timing runs: nothing to reach
        cfg.data.train_images, cfg.train.epochs = 16, 1
        rec = execute(cfg, db)
        run = {n: v for _, ph, n, v in rec.metrics if ph == "run"}
        lines.append(f"| {layout_name} | {stats} | {rec.status} | "
                     f"{_f(run.get('step_time_s'), 1e-3, 2)} | {_f(run.get('alloc_peak_total_bytes'), MB, 0)} |")
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], gpu: str, args) -> str:
    lines = [f"# Tri-Accel on the U-Net ({gpu})", "",
             f"torch {torch.__version__}, budget {args.budget}, {args.epochs} epochs of "
             f"{args.train_images} synthetic phantoms, batch 1 at start; validation in float32 "
             f"(train.val_precision) in every row. Score = Q / (T x M) x 100 "
             f"(docs/triaccel.md). Energy: NVML counter over the training loop; time to target: "
             f"wall time until the validation loss first reached {args.target} (- never)."
             + (f" Every tri_accel spec + `{args.tri_extra}`" if args.tri_extra else "")
             + ((f": the best trial (run {args.tuned_run}) of `memstudy tune {args.tune_spec}` in "
                 f"{args.source}." if args.source else ".") if args.tri_extra else "")
             + " " + primed_note(args.prime), ""]
    for size in sorted({r["size"] for r in rows}):
        here = [r for r in rows if r["size"] == size]
        base = next((r for r in here if r["name"] == "fp32" and r.get("peak_bytes")), None)
        lines += [f"## {size} px", "",
                  "| config | status | val MS-SSIM % | time/epoch s | peak MB | memory % | "
                  "vs fp32 | max batch | curvature share | energy J | time to target s | score |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [row_line(r, base) for r in here]
        lines.append("")
    return "\n".join(lines)


def row_line(r: dict, base: dict | None) -> str:
    """One ablation row; `base` (the fp32 row of the size) gives the memory reduction."""
    red = (f"{100 * (1 - r['peak_bytes'] / base['peak_bytes']):+.1f}% less"
           if base and r.get("peak_bytes") else "-")
    return (f"| {r['name']} | {r['status']} | {_f(r.get('quality_pct'))} | "
            f"{_f(r.get('time_per_epoch_s'))} | {_f(r.get('peak_bytes'), MB, 0)} | "
            f"{_f(r.get('memory_pct'))} | {red} | {r.get('max_batch')} | "
            f"{_f(r.get('curvature_share'), 1, 3)} | {_f(r.get('energy_j'), 1, 0)} | "
            f"{_f(r.get('time_to_target_s'), 1, 1)} | {_f(r.get('score'), 1, 3)} |")


def _f(v, div: float = 1, nd: int = 2) -> str:
    return "-" if v is None else f"{v / div:.{nd}f}"


if __name__ == "__main__":
    raise SystemExit(main())
