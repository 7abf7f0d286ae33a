"""The budget ladder: largest trainable square size per emulated budget, and
native 4188 x 4188 training under 4 GiB.

--part ladder: for each budget in --budgets (CUDA context included, emulated as docs/budget.md
  describes) and each technique set in --sets, `memstudy.maxres` predicts and then searches the
  largest trainable size on the --step px grid (default 64; each probe a short training run in
  its own process), then trains each found size --quality-steps steps under the budget and
  validates (the rung's memory, time and validation MS-SSIM in one run). Writes
  --out/ladder.sqlite, --out/quality.sqlite and --out/ladder.md (one table per budget, GPU named).
--part native: at --size (default 4188) trains --steps steps of phantoms and validates, each run
  in its own process: the tiled set(s) under --budget (default 4GiB), any --free-sets without a
  budget, unconstrained amp:bf16 with pytorch-msssim's loss (the tuned loop's step: the time
  reference), unconstrained amp:bf16 with memstudy's default chunked loss, and unconstrained
  float32 (no technique, cudnn.benchmark off). Writes --out/native.sqlite and --out/native.md:
  status, run peak, step time beside the tuned amp:bf16's, validation MS-SSIM beside float32's
  (same steps, same data, same seed).

    python benchmarks/bench_ladder.py --part ladder --out gpu-out/results/ladder --budgets 4GiB
    python benchmarks/bench_ladder.py --part native --out gpu-out/results/ladder --steps 12
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# the best sets measured (docs/techniques/tile.md, "Measured"): boundary offload + keep=all at
# levels=2 up to 6 GiB, levels=3 with layer1 cut at its convolutions for 8192 px under 8 GiB,
# one boundary prefetched. At 4 GiB the last boundary (the top region's input) is held on the
# device (offload:hold=1, native-4188-4gib-hold.md); keep=half's fewer sweeps cost more bus
# traffic than they save (native-4188-4gib-half*.md). Since the decoder up-samples in bf16
# (memstudy/models/unet.py) taller strips fit: NATIVE_SET, 4 strips, is the fastest at 4188 px
# under 4 GiB (0.231 s against 0.253 s with 8 in one run, 0.219 / 0.224 against 0.221 s in
# another: native-4188-4gib-strips*.md) but stops at 4096 px on the 4 GiB ladder, where BEST's
# 8 strips reach further (ladder-4gib-strips4.md, ladder-4gib-rows.md); at 8 GiB 8 strips fit
# since a region's inputs come back once per backward (0.983 s against 1.065 / 1.076 s with
# 12, native-8192-8gib-strips8.md, -shared-inputs-b-*.md; 16 took 1.223 s against 12's 1.076 s,
# native-8192-8gib-strips.md).
BEST = ("amp:bf16,checkpoint,offload:which=boundaries:prefetch=1:hold=1,tile:8:keep=all,"
        "allocator:expandable_segments=true")
BEST_LEVELS3 = ("amp:bf16,checkpoint,offload:which=boundaries:prefetch=1,"
                "tile:8:levels=3:keep=conv1:layer1=convs,allocator:expandable_segments=true")
LADDER_SETS = f"{BEST};{BEST_LEVELS3}"
NATIVE_SET = ("amp:bf16,checkpoint,offload:which=boundaries:prefetch=1:hold=1,tile:4:keep=all,"
              "allocator:expandable_segments=true")
# The 8 GiB set with its tiled-only boundaries in host memory (tile:stream; docs/techniques/
# tile.md, "Streaming boundaries"), down to the 1/8-res level (levels=4: layer2 tiled too), for
# sizes where they no longer fit beside the untiled levels
STREAM_SET = ("amp:bf16,checkpoint,offload:which=boundaries:prefetch=1,"
              "tile:16:levels=4:keep=conv1:layer1=convs:stream=true,"
              "allocator:expandable_segments=true")
# The 2 GiB rung (docs/budget.md): the streaming set with narrower strips and Adam's moments in
# host memory, so the device holds the parameters, the untiled levels and one strip's work
STREAM_2GIB_SETS = ";".join(
    STREAM_SET.replace("tile:16:", f"tile:{strips}:") + ",offload_optim" for strips in (16, 32))
# tile:auto's calibration (memstudy/tiling/auto.py): the plans it chooses among (and candidate
# ones), each at two strip heights, run unconstrained at two sizes; their allocator peaks fit its
# model. Streamed plans are calibrated with their copies on the compute stream (ahead=false):
# tile:auto adds what copying a tile ahead holds as counted, not fitted
AUTO_PLANS = {
    "levels2": "tile:rows={rows}:keep=all",
    "levels3": "tile:rows={rows}:levels=3:keep=conv1:layer1=convs",
    "levels4-stream": "tile:rows={rows}:levels=4:keep=conv1:layer1=convs:stream=true:ahead=false",
    "levels4-stream-blocks":
        "tile:rows={rows}:levels=4:keep=conv1:layer1=blocks:stream=true:ahead=false",
    "levels4-stream-whole":
        "tile:rows={rows}:levels=4:keep=conv1:layer1=whole:stream=true:ahead=false",
}


def calibration_sets(plans=tuple(AUTO_PLANS)) -> str:
    """The calibration runs of the named plans, ';'-joined: each at 256 and 1024 rows."""
    unknown = [plan for plan in plans if plan not in AUTO_PLANS]
    if unknown:
        raise SystemExit(f"unknown calibration plan(s) {', '.join(unknown)}: give some of "
                         f"{', '.join(AUTO_PLANS)} (AUTO_CALIBRATION_PLANS)")
    return ";".join(
        f"amp:bf16,checkpoint,offload:which=boundaries:prefetch=1,"
        f"{AUTO_PLANS[plan].format(rows=rows)},allocator:expandable_segments=true"
        for plan in plans for rows in (256, 1024))


AUTO_CALIBRATION_SETS = calibration_sets()
# One set for every size (docs/techniques/tile.md, "tile:auto"): tile's levels, strips and
# streaming picked from the budget and the image; under 2 GiB Adam's moments go to the host
AUTO_SET = ("amp:bf16,checkpoint,offload:which=boundaries:prefetch=1,tile:auto,"
            "allocator:expandable_segments=true")
# tile:auto with the top region's input held on the device (offload:hold=1): about 20 ms of
# copies less a step at 4188 px under 4 GiB, same plan (benchmarks/results/h200/hold-4188-4gib/)
AUTO_HOLD_SET = AUTO_SET.replace("prefetch=1,", "prefetch=1:hold=1,")
# With 8 GiB at 4188 px nothing needs to leave the device: the 4 GiB set without offload's copies
RESIDENT_SET = "amp:bf16,checkpoint,tile:4:keep=all,allocator:expandable_segments=true"
# The 4 GiB set's extra matrix work is checkpoint recomputing the untiled levels (1.33x of its
# 1.35x, benchmarks/results/cpu/step-flops/): `selective` recomputes no convolution (1.07x in
# all) and keeps their outputs, which offload:which=all moves to the host and back, so PCIe
# traffic, overlapped with the GPU's work, replaces the recomputation
SELECTIVE_SET = ("amp:bf16,checkpoint:selective,offload:which=all:prefetch=1,tile:4:keep=all,"
                 "allocator:expandable_segments=true")
# Between the two: recompute only the blocks whose activations are large for their work. A
# ResNet block's work is the same at every stage while its activations halve per stage, so
# layer4 and decoder block 0 (1/32 and 1/16 res) stay saved: 1.289x the plain step's matrix
# work instead of 1.352x, for 53 MiB more saved at 1040 px (about 0.86 GiB at 4188 px, kept
# on the device), so 5 strips where tile:auto takes 3 (benchmarks/results/cpu/step-flops/)
PARTIAL_MODULES = "+".join(
    [f"net.encoder.layer{stage}.{block}" for stage, blocks in ((1, 3), (2, 4), (3, 6))
     for block in range(blocks)] + ["net.decoder.blocks.1", "net.decoder.blocks.2"])
PARTIAL_SET = (f"amp:bf16,checkpoint:modules:modules={PARTIAL_MODULES},"
               "offload:which=boundaries:prefetch=1,tile:rows=840:keep=all,"
               "allocator:expandable_segments=true")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--part", choices=("ladder", "native"), required=True)
    p.add_argument("--budgets", default="2GiB,4GiB,6GiB,8GiB",
                   help="ladder: budgets, comma-separated")
    p.add_argument("--sets", default=LADDER_SETS,
                   help="ladder: technique sets, ';'-separated")
    p.add_argument("--fit-sizes", default="1024,2048",
                   help="ladder: sizes fitted for the prediction")
    p.add_argument("--max-size", type=int, default=8192, help="ladder: largest size probed")
    p.add_argument("--step", type=int, default=64, help="ladder: the search's grid (px)")
    p.add_argument("--quality-steps", type=int, default=8,
                   help="ladder: after each search, train this many steps at the found size "
                        "under the same budget and validate (0: no quality run)")
    p.add_argument("--steps", type=int, default=8, help="native: training steps per run")
    p.add_argument("--warmup", type=int, default=2,
                   help="native: warm-up steps (the budget caps the allocator after the last, by "
                        "the CUDA context as grown by then)")
    p.add_argument("--size", default="4188", help="native: image size")
    p.add_argument("--budget", default="4GiB", help="native: budget of the tiled run")
    p.add_argument("--tiled-set", default=NATIVE_SET,
                   help="native: techniques of the tiled run(s) under --budget, ';'-separated; "
                        "a run's own settings follow its set, '|'-separated "
                        "(SET|train.loss_chunk_rows=1024)")
    p.add_argument("--tiled-settings", default="",
                   help="native: KEY=VALUE run settings for the tiled run(s), ';'-separated "
                        "(e.g. train.loss_chunk_rows=1024); named in the run's label")
    p.add_argument("--network", default="",
                   help="KEY=VALUE settings of the network and task for every run (the tuned "
                        "reference included), ';'-separated, e.g. "
                        "'model.encoder=resnet50;train.task=segment'")
    p.add_argument("--free-sets", default="",
                   help="native: more sets run without a budget (e.g. to see what a tiled set "
                        "needs and costs unconstrained), ';'-separated")
    p.add_argument("--no-float32", action="store_true",
                   help="native: skip the float32 reference (quality column then empty)")
    p.add_argument("--no-references", action="store_true",
                   help="native: run the tiled and free sets only (no amp:bf16 / float32 "
                        "references: e.g. at sizes where an absolute step time is the target)")
    p.add_argument("--tuned-only", action="store_true",
                   help="native: of the references, only the tuned amp:bf16 step (the ratio's "
                        "denominator)")
    p.add_argument("--timeout", type=float, default=600, help="per-run / per-probe timeout (s)")
    return p.parse_args(argv)


# -- ladder --------------------------------------------------------------------------------
def ladder(args: argparse.Namespace, out: Path) -> int:
    from memstudy.config import RunConfig, set_value
    from memstudy.maxres import maxres_table, search_all
    from memstudy.runner import eprint

    db = out / "ladder.sqlite"
    sets = [s.split(",") for s in args.sets.split(";") if s]
    lines = ["# Budget ladder: largest trainable square size", "",
             f"Recorded {time.strftime('%Y-%m-%d %H:%M')}; budgets include the CUDA context "
             "(docs/budget.md); each probe trains a few steps without validation.",
             f"Network and task: {args.network or 'the study default (resnet34 U-Net, enhance)'}."]
    failed = False
    for budget in [b for b in args.budgets.split(",") if b]:
        cfg = RunConfig(budget=budget)
        cfg.train.device = "cuda"
        cfg.train.validate = False
        for setting in _sets(args.network):
            set_value(cfg, setting)
        results = search_all(copy.deepcopy(cfg), sets, db,
                             fit_sizes=[int(s) for s in args.fit_sizes.split(",")],
                             max_size=args.max_size, timeout_s=args.timeout, progress=eprint,
                             step=args.step)
        failed |= any(r.error for r in results)
        gpus = sorted({p.gpu_name for r in results for p in r.probes if p.gpu_name})
        lines += ["", f"## {budget} (GPU: {', '.join(gpus) or 'unknown'})", "", "```",
                  maxres_table(results), "```"]
        lines += quality_at_found(results, budget, args, out)
        (out / "ladder.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


def quality_at_found(results, budget: str, args: argparse.Namespace, out: Path) -> list[str]:
    """Each set trained --quality-steps steps at its found size under the budget, validated:
    the rung's measured memory, time and quality in one run (quality.sqlite)."""
    if args.quality_steps < 1:
        return []
    db = out / "quality.sqlite"
    before = _run_ids(db)
    for r in results:
        if r.found_px:
            run_native(db, _with(args, size=str(r.found_px), steps=args.quality_steps),
                       f"{','.join(r.techniques)} at {r.found_px} px under {budget}",
                       ",".join(r.techniques), budget, tuple(_sets(args.network)))
    found = max((r.found_px for r in results if r.found_px), default=None)
    if found:  # the rung's time reference: the tuned step, unconstrained, at the found size
        run_native(db, _with(args, size=str(found), steps=args.quality_steps), TUNED_LABEL,
                   "amp:bf16", None, tuple(_sets(args.network)) + TUNED_SETTINGS)
    rows = native_table(db, exclude=before)
    heading = (f"Training at the found size ({args.quality_steps} steps, validated), beside the "
               f"tuned amp:bf16 step unconstrained at {found} px:")
    return ["", heading, ""] + rows[2:]


def _run_ids(db: Path) -> set[int]:
    from memstudy.store import ResultsDB

    return {r["id"] for r in ResultsDB(db).query("SELECT id FROM runs")} if db.exists() else set()


def _with(args: argparse.Namespace, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


# -- native size under a budget -----------------------------------------------------------
# float32 (TF32 off) convolutions at 4188 px: cuDNN's autotuning takes minutes on an H100
FLOAT32_SETTINGS = ("train.cudnn_benchmark=false",)
# The time reference: amp:bf16 as the tuned hand-written loop runs it, with pytorch-msssim's own
# loss (bench_overhead: memstudy's step within 2% of that loop). memstudy's default chunked loss
# is slower (bench_loss.py), so a ratio to the default amp:bf16 row would flatter every set.
TUNED_LABEL = "amp:bf16 unconstrained, pytorch-msssim loss (the tuned loop's step)"
TUNED_SETTINGS = ("train.loss_chunk_rows=0",)


def native_runs(args: argparse.Namespace) -> list[tuple[str, str, str | None, tuple[str, ...]]]:
    """(label, techniques, budget, extra settings) of the runs: the tiled set(s) under the
    budget, the free sets, then the references amp:bf16 (time) and float32 (quality)."""
    network = tuple(_sets(args.network))
    common = network + tuple(_sets(args.tiled_settings))
    runs = []
    for entry in _sets(args.tiled_set):  # "SET" or "SET|KEY=VALUE|..." (settings of that run)
        techniques, *own = entry.split("|")
        settings = common + tuple(own)
        named = "".join(f", {t}" for t in settings)
        runs.append((f"{techniques} under {args.budget}{named}", techniques, args.budget, settings))
    runs += [(f"{s} unconstrained", s, None, network) for s in _sets(args.free_sets)]
    if args.no_references:
        return runs
    runs.append((TUNED_LABEL, "amp:bf16", None, network + TUNED_SETTINGS))
    if args.tuned_only:
        return runs
    runs.append(("amp:bf16 unconstrained", "amp:bf16", None, network))
    if not args.no_float32:
        runs.append(("float32 unconstrained, cudnn.benchmark off", "none", None,
                     network + FLOAT32_SETTINGS))
    return runs


def _sets(text: str) -> list[str]:
    return [s for s in text.split(";") if s]


def run_native(db: Path, args: argparse.Namespace, label: str, techniques: str,
               budget: str | None, settings: tuple[str, ...]) -> None:
    steps = args.steps
    cmd = [sys.executable, "-m", "memstudy", "--db", str(db), "run", "--size", args.size,
           "-t", techniques, "--device", "cuda", "--steps", str(steps), "-q", "--label", label,
           "--set", f"train.warmup_steps={args.warmup}",
           "--set", f"train.measure_steps={min(2, steps - args.warmup)}",
           "--set", f"data.train_images={steps}", "--set", "data.val_images=2",
           "--set", "meter.profile=true"]
    if budget:
        cmd += ["--budget", budget]
    for setting in settings:
        cmd += ["--set", setting]
    print("+", " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, check=False, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"{label} timed out after {args.timeout:.0f} s", flush=True)


def native_table(db: Path, exclude: set[int] = frozenset()) -> list[str]:
    from memstudy.store import ResultsDB

    rdb = ResultsDB(db)
    rows = []
    for r in rdb.query("SELECT * FROM runs ORDER BY id"):
        if r["id"] in exclude:
            continue
        metrics = {phase: m for (_rank, phase), m in rdb.metrics(r["id"]).items()}
        run = metrics.get("run", {})
        epochs = rdb.epochs(r["id"])
        last = epochs[-1] if epochs else {}
        # segmentation is validated by Dice, enhancement by MS-SSIM (1 - its loss)
        dice, val = last.get("val_dice"), last.get("val_loss")
        peaks = [m["alloc_peak_bytes"] + m.get("alloc_start_bytes", 0)
                 for m in metrics.values() if "alloc_peak_bytes" in m]
        rows.append({"label": r["label"] or r["name"], "status": r["status"],
                     "started": r["started_at"],
                     "phase": r["failed_phase"],
                     "peak": max(peaks) if peaks else None, "gpu": r["gpu_name"],
                     # this process's device memory (recorded from 2026-11-29 on); older
                     # records have the whole device's, NVML's idle count included
                     "nvml": run.get("nvml_process_peak_bytes") or max(
                         (m.get("nvml_peak_bytes", 0) for m in metrics.values()), default=0),
                     "whole_device": "nvml_process_peak_bytes" not in run,
                     "step": run.get("step_time_s") or run.get("metered_step_time_s"),
                     "spread": _spread(run),
                     "retries": run.get("alloc_retries"),
                     "timed_retries": _timed_retries(rdb, r["id"]),
                     "quality": (f"Dice {dice:.4f}" if dice is not None else
                                 None if val is None else f"MS-SSIM {1 - val:.4f}"),
                     "msssim": None if val is None or dice is not None else 1 - val,
                     **_profile_of(rdb, r["id"]),
                     "error": (r["error"] or "")[:100]})
    tuned = next((r["step"] for r in rows if r["label"] == TUNED_LABEL), None)
    # databases recorded before the tuned row existed: against the default amp:bf16, said so
    bf16 = tuned or next((r["step"] for r in rows if r["label"] == "amp:bf16 unconstrained"), None)
    reference = ("time / tuned amp:bf16" if tuned else
                 "time / amp:bf16 (chunked loss; no tuned row recorded)")
    fp32 = next((r["msssim"] for r in rows if r["label"].startswith("float32")), None)
    gpus = sorted({r["gpu"] for r in rows if r["gpu"]})
    # the runs' own date (a table rewritten later from the database keeps it)
    when = time.strftime('%Y-%m-%d %H:%M', time.gmtime(max((r["started"] for r in rows),
                                                          default=time.time())))
    lines = [f"GPU: **{', '.join(gpus) or 'unknown'}**; recorded {when} UTC. "
             "Allocator peak = largest absolute allocator peak of any phase (no CUDA context); "
             "NVML peak = this process's device memory (NVML's used less what it counted before the "
             "process started), CUDA context included; \"(device)\": a record without that "
             "baseline, the whole device's used memory. Validation: MS-SSIM (enhancement) or Dice (segmentation) after the "
             "same steps on the same phantoms. Retries: the allocator's `num_alloc_retries` over the "
             "run, and over its timed steps (series `alloc_retries`; docs/metrics.md). Step s: the "
             "median of the plain steps, with the fastest and the slowest where recorded.", "",
             "| run | status | allocator peak MiB | NVML peak MiB | retries (run / timed) | step s | "
             f"{reference} | launches / step | GPU busy ms / step | validation | vs float32 | "
             "error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['step'] / bf16:.2f}" if r["step"] and bf16 else "-"
        rel = f"{(r['msssim'] - fp32) / fp32:+.2%}" if r["msssim"] is not None and fp32 else "-"
        lines.append(" | ".join([
            f"| {r['label']}", r["status"] + (f" in {r['phase']}" if r["phase"] else ""),
            f"{r['peak'] / 2**20:.0f}" if r["peak"] else "-",
            (f"{r['nvml'] / 2**20:.0f}" + (" (device)" if r["whole_device"] else ""))
            if r["nvml"] else "-",
            "-" if r["retries"] is None else f"{r['retries']:.0f}" + (
                "" if r["timed_retries"] is None else f" / {r['timed_retries']:.0f}"),
            (f"{r['step']:.3f}" + r["spread"]) if r["step"] else "-", ratio,
            f"{r['launches']:.0f}" if r.get("launches") else "-",
            f"{r['busy']:.1f}" if r.get("busy") else "-",
            r["quality"] or "-", rel, r["error"] + " |"]))
    return lines


def _spread(run: dict[str, float]) -> str:
    """' (fastest-slowest of N)' of a run's plain steps; '' for records without them."""
    if "plain_steps" not in run:
        return ""
    return (f" ({run['step_time_min_s']:.3f}-{run['step_time_max_s']:.3f} of "
            f"{run['plain_steps']:.0f})")


def _timed_retries(rdb, run_id: int) -> float | None:
    """Allocator retries during the timed steps (series `alloc_retries` after the warm-up
    steps); None for runs recorded before the series existed."""
    rows = list(rdb.series(run_id, "alloc_retries"))
    if not rows:
        return None
    config = json.loads(rdb.query("SELECT config_json FROM runs WHERE id = ?",
                                  (run_id,))[0]["config_json"])
    warmup = config["train"]["warmup_steps"]
    return sum(r["value"] for r in rows if r["step"] > warmup)


def _profile_of(rdb, run_id: int) -> dict[str, float]:
    """The run's profiled warm-up step (meter.profile): launches and GPU-busy ms per step."""
    found = {r["name"]: r["value"] for r in rdb.series(run_id, "%_per_step")}
    return {"launches": found.get("launches_per_step"), "busy": found.get("gpu_busy_ms_per_step")}


def native(args: argparse.Namespace, out: Path) -> int:
    db = out / "native.sqlite"
    for label, techniques, budget, settings in native_runs(args):
        run_native(db, args, label, techniques, budget, settings)
    text = "\n".join([f"# {args.size} px trained under {args.budget} with exact tiling", "",
                      *native_table(db)]) + "\n"
    (out / "native.md").write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return ladder(args, out) if args.part == "ladder" else native(args, out)


if __name__ == "__main__":
    sys.exit(main())
