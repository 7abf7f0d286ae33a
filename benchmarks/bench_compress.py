"""Activation compression and prefetching offload on one GPU (issue 14), run by the lead.

    python benchmarks/bench_compress.py --part memory --sizes 2048,4160 --out results/compress
    python benchmarks/bench_compress.py --part kernels --out results/compress
    python benchmarks/bench_compress.py --part offload --sizes 4160 --out results/compress
    python benchmarks/bench_compress.py --part quality --out results/compress
    python benchmarks/bench_compress.py --part breakdown --sizes 2048 --out results/compress
    python benchmarks/bench_compress.py --part breakdown --sizes 256 --device cpu --out /tmp/c

Parts (each run is `memstudy.runner.execute` of one configuration, recorded in
--out/compress.sqlite; each part writes --out/compress-<part>.md and .json):
- memory: per size, original / checkpoint / amp:bf16 sets, alone and with compress at 8, 4,
  2 bits (and `which=boundaries` with checkpoint; with tile where memstudy has it): saved
  bytes after forward, the compress figures (saved bytes before / after, gradient cosine and
  relative error at the probed warm-up step), peak memory and step time.
- kernels: quantise / restore (8 / 4 / 2 bits, float32 and bfloat16) and the ReLU sign-mask
  kernels against their PyTorch references, CUDA-event medians on activation-sized tensors.
- offload: amp:bf16 + checkpoint with offload at prefetch 0 (each copy made when backward
  asks for it) and prefetch 2 / 4 / 8, offload of boundaries only, compress + offload, and
  the same set without offload: the time offload adds and how much of it prefetching hides.
- quality: equal training (--steps steps at --quality-size px, then validation) uncompressed
  and at 8 / 4 / 2 bits: validation loss (1 - MS-SSIM), SSIM, PSNR.
- breakdown (GPU or --device cpu): one forward per size and set with compress at 4 bits, the
  saved bytes before / after by kind (`Compressor.tally_by_kind`: quantized, ReLU masks,
  max-pool offsets, kept as they are and why): what limits the ratio.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from memstudy.config import RunConfig
from memstudy.runner import execute
from memstudy.store import ResultsDB
from cuda_timing import median_ms  # benchmarks/ is on sys.path when run as a script

BITS = (8, 4, 2)


def config(size: int, techniques: list[str], steps: int, validate: bool = False,
           warmup: int = 2, measure: int = 2, device: str = "cuda") -> RunConfig:
    cfg = RunConfig(techniques=techniques, label="bench_compress")
    t = cfg.train
    t.image_size, t.device, t.validate = size, device, validate
    t.warmup_steps, t.measure_steps, t.max_steps = warmup, measure, steps
    t.epochs = 1
    cfg.data.train_images, cfg.data.val_images = steps, (4 if validate else 1)
    return cfg


def run(db: ResultsDB, cfg: RunConfig) -> dict:
    """One configuration; its figures flattened: phase_name -> value, series names -> last."""
    record = execute(cfg, db)
    out = {"name": record.name, "status": record.status, "error": record.error,
           "failed_phase": record.failed_phase}
    out.update({f"{phase}.{name}": v for _, phase, name, v in record.metrics})
    for _, step, name, v in record.series:
        if name.startswith(("compress_", "offload_")):
            out[name] = v  # per-step rows: the last step's; the probe's: its one row
    for epoch in record.epochs:
        out.update({k: v for k, v in epoch.items() if k.startswith("val_")})
    print(f"  {out['name']}: {out['status']} step {out.get('run.step_time_s')} s "
          f"saved {out.get('forward.saved_bytes')}", flush=True)
    torch.cuda.empty_cache()
    return out


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2 ** 20:.1f}"


def _num(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _has_tile() -> bool:
    from memstudy.techniques import list_techniques
    return any(t.name == "tile" for t in list_techniques())


# -- parts -----------------------------------------------------------------------------------
def parse_bases(text: str) -> list[list[str]]:
    """'original,amp:bf16+checkpoint' -> [[], ['amp:bf16', 'checkpoint']]; tile sets are
    dropped while memstudy has no tile technique."""
    bases = [[] if b == "original" else b.split("+") for b in text.split(",")]
    return [b for b in bases if "tile" not in b or _has_tile()]


def part_memory(db: ResultsDB, sizes: list[int], steps: int, bases: list[list[str]],
                groupings: list[str] = ("channel",)) -> tuple[list[str], list[dict]]:
    lines = ["| size | set | status | saved MiB | compress before / after MiB | ratio | grad cosine | "
             "grad rel. error | peak MiB | step s |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for size in sizes:
        for base in bases:
            specs = [f"compress:bits={b}" for b in BITS]
            if "checkpoint" in base:  # region inputs at 4 bits too (default 8), and only them
                specs += ["compress:bits=4:boundary_bits=4", "compress:bits=4:which=boundaries"]
            suffixes = ["" if g == "channel" else f":groups={g}" for g in groupings]
            variants = [base] + [base + [spec + suffix] for suffix in suffixes for spec in specs]
            for techniques in variants:
                r = run(db, config(size, techniques, steps))
                r["size"] = size
                rows.append(r)
                before, after = r.get("compress_saved_before_bytes"), r.get("compress_saved_after_bytes")
                ratio = before / after if before and after else None
                lines.append(
                    f"| {size} | {r['name']} | {r['status']} | {_mib(r.get('forward.saved_bytes'))} | "
                    f"{_mib(before)} / {_mib(after)} | {_num(ratio, '{:.2f}')} | "
                    f"{_num(r.get('compress_grad_cosine'), '{:.5f}')} | "
                    f"{_num(r.get('compress_grad_rel_error'), '{:.4f}')} | "
                    f"{_mib(r.get('run.alloc_peak_total_bytes'))} | {_num(r.get('run.step_time_s'))} |")
    return lines, rows


def _time_ms(fn, repeat: int = 20) -> float:
    return median_ms(fn, repeat)


def part_kernels(numel: int) -> tuple[list[str], list[dict]]:
    import memstudy.techniques.compress.quantize as qk
    lines = [f"Tensor of {numel / 2 ** 20:.0f} Mi elements (a 64-channel map of "
             f"{int((numel / 64) ** 0.5)} px squared), group 256; median of 20 launches. "
             "*_channels: channel-major groups of 256 pixels of one of the 64 channels "
             "(channels-last memory).\n",
             "| op | dtype | bits | triton ms | reference ms | speed-up | GB/s (triton, input + output) |",
             "|---|---|---|---|---|---|---|"]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(numel, device="cuda").to(dtype)
        for bits in BITS:
            noise = torch.rand(numel, device="cuda")
            parts = qk.quantize(x, bits, 256, 1)
            cases = {
                "quantize": (lambda: qk.quantize(x, bits, 256, 1),
                             lambda: qk.quantize_reference(x, bits, 256, torch.rand_like(noise))),
                "dequantize": (lambda: qk.dequantize(*parts, numel, bits, 256, dtype),
                               lambda: qk.dequantize_reference(*parts, numel, bits, 256, dtype)),
            }
            # channel-major groups (channels-last activations): the same elements as a
            # [numel / 64, 64] matrix, each group 256 pixels of one channel
            cparts = qk.quantize_channels(x, 64, bits, 256, 1)
            cases.update({
                "quantize_channels": (
                    lambda: qk.quantize_channels(x, 64, bits, 256, 1),
                    lambda: qk.quantize_channels_reference(x, 64, bits, 256, torch.rand_like(noise))),
                "dequantize_channels": (
                    lambda: qk.dequantize_channels(*cparts, numel, 64, bits, 256, dtype),
                    lambda: qk.dequantize_channels_reference(*cparts, numel, 64, bits, 256, dtype)),
            })
            moved = x.nbytes + sum(p.nbytes for p in parts)
            for op, (kernel, reference) in cases.items():
                k, r = _time_ms(kernel), _time_ms(reference)
                rows.append({"op": op, "dtype": str(dtype), "bits": bits, "triton_ms": k, "reference_ms": r})
                lines.append(f"| {op} | {dtype} | {bits} | {k:.3f} | {r:.3f} | {r / k:.1f}x | "
                             f"{moved / k / 1e6:.0f} |")
        signs = qk.pack_signs(x)
        for op, kernel, reference in (
                ("pack_signs", lambda: qk.pack_signs(x), lambda: qk.pack_signs_reference(x)),
                ("apply_signs", lambda: qk.apply_signs(x, signs), lambda: qk.apply_signs_reference(x, signs))):
            k, r = _time_ms(kernel), _time_ms(reference)
            rows.append({"op": op, "dtype": str(dtype), "bits": 1, "triton_ms": k, "reference_ms": r})
            lines.append(f"| {op} | {dtype} | 1 | {k:.3f} | {r:.3f} | {r / k:.1f}x | - |")
    return lines, rows


def part_offload(db: ResultsDB, sizes: list[int], steps: int) -> tuple[list[str], list[dict]]:
    base = ["amp:bf16", "checkpoint"]
    sets = [base, base + ["offload"]] + [base + [f"offload:prefetch={n}"] for n in (2, 4, 8)] + [
        base + ["offload:prefetch=4:which=boundaries"],
        base + ["compress:bits=4", "offload"], base + ["compress:bits=4", "offload:prefetch=4"]]
    lines = ["| size | set | status | step s | offload time s | hidden by prefetch | host MiB | "
             "device saved MiB | peak MiB | prefetched / on demand |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for size in sizes:
        results = [run(db, config(size, techniques, steps)) for techniques in sets]
        plain_t = results[0].get("run.step_time_s")
        today_t = results[1].get("run.step_time_s")
        for r in results:
            r["size"] = size
            t = r.get("run.step_time_s")
            added = t - plain_t if t and plain_t else None
            hidden = ((today_t - t) / (today_t - plain_t)
                      if t and plain_t and today_t and today_t > plain_t and "prefetch" in r["name"] else None)
            lines.append(
                f"| {size} | {r['name']} | {r['status']} | {_num(t)} | {_num(added)} | "
                f"{_num(hidden, '{:.0%}')} | {_mib(r.get('forward.saved_host_bytes'))} | "
                f"{_mib(r.get('forward.saved_bytes'))} | {_mib(r.get('run.alloc_peak_total_bytes'))} | "
                f"{_num(r.get('offload_prefetched'), '{:.0f}')} / {_num(r.get('offload_on_demand'), '{:.0f}')} |")
            rows.append(r)
    return lines, rows


def part_quality(db: ResultsDB, size: int, steps: int) -> tuple[list[str], list[dict]]:
    lines = [f"{steps} optimizer steps at {size} px (Adam, lr 1e-3, seed 0), then validation on 4 "
             "phantoms.\n", "| set | status | val loss (1 - MS-SSIM) | val SSIM | val PSNR dB | "
             "MS-SSIM vs uncompressed | grad cosine (probe) |", "|---|---|---|---|---|---|---|"]
    rows = [run(db, config(size, t, steps, validate=True, measure=1))
            for t in ([[]] + [[f"compress:bits={b}"] for b in BITS])]
    ref = rows[0].get("val_loss")
    for r in rows:
        loss = r.get("val_loss")
        rel = ((1 - loss) / (1 - ref) - 1) if loss is not None and ref is not None else None
        lines.append(f"| {r['name']} | {r['status']} | {_num(loss, '{:.4f}')} | "
                     f"{_num(r.get('val_ssim'), '{:.4f}')} | {_num(r.get('val_psnr'), '{:.2f}')} | "
                     f"{_num(rel, '{:+.2%}')} | {_num(r.get('compress_grad_cosine'), '{:.5f}')} |")
    return lines, rows


BREAKDOWN_SETS = ("original", "amp:bf16", "checkpoint", "amp:bf16+checkpoint")


def part_breakdown(sizes: list[int], device: str) -> tuple[list[str], list[dict]]:
    from memstudy.techniques.compose import build_pipeline, make_plan
    lines = ["One training forward (batch of train.batch_size, random images) with "
             "`compress:bits=4:grad_probe=false` added to each set; bytes saved for backward "
             "by kind.\n", "| size | set | kind | before MiB | after MiB | share of after | "
             "ratio |", "|---|---|---|---|---|---|---|"]
    rows = []
    for size in sizes:
        for base in parse_bases(",".join(BREAKDOWN_SETS)):
            cfg = config(size, base + ["compress:bits=4:grad_probe=false"], 1, device=device)
            build = build_pipeline(make_plan(cfg))
            compressor = build.notes["compress"].compressor
            gen = torch.Generator().manual_seed(0)
            x, y = (torch.rand(cfg.train.batch_size, 1, size, size, generator=gen).to(build.device)
                    for _ in range(2))
            loss = build.runtime.forward(build.model, x, y)
            kinds = compressor.tally_by_kind()
            build.runtime.backward(loss)
            del loss, build
            before, after = (sum(v[i] for v in kinds.values()) for i in (0, 1))
            name = "+".join(base) or "original"
            for kind, (b, a) in sorted(kinds.items(), key=lambda kv: -kv[1][1]) + [
                    ("all", (before, after))]:
                rows.append({"size": size, "set": name, "kind": kind, "before_bytes": b,
                             "after_bytes": a})
                lines.append(f"| {size} | {name} | {kind} | {_mib(b)} | {_mib(a)} | "
                             f"{_num(a / after, '{:.1%}')} | {_num(b / a if a else None, '{:.2f}')} |")
            if device == "cuda":
                torch.cuda.empty_cache()
    return lines, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--part", required=True,
                   choices=("memory", "kernels", "offload", "quality", "breakdown"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="breakdown only: the CPU runs the PyTorch references")
    p.add_argument("--sizes", default="2048,4160", help="image sizes (memory, offload parts)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per memory/offload run")
    p.add_argument("--bases", default="original,checkpoint,amp:bf16+checkpoint,amp:bf16+tile",
                   help="memory part: technique sets compress joins ('+' joins techniques)")
    p.add_argument("--groupings", default="channel", help="memory part: compress's `groups` "
                   "options to run, e.g. channel,memory (channels-last grouping compared)")
    p.add_argument("--quality-size", type=int, default=768)
    p.add_argument("--quality-steps", type=int, default=24)
    p.add_argument("--numel", type=int, default=64 * 2048 * 2048, help="kernel benchmark size")
    args = p.parse_args()
    if not torch.cuda.is_available() and not (args.part == "breakdown" and args.device == "cpu"):
        sys.exit("bench_compress needs a CUDA GPU (the breakdown part also runs with --device cpu)")
    args.out.mkdir(parents=True, exist_ok=True)
    db = ResultsDB(str(args.out / "compress.sqlite"))
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.part == "memory":
        lines, rows = part_memory(db, sizes, args.steps, parse_bases(args.bases),
                                  args.groupings.split(","))
    elif args.part == "kernels":
        lines, rows = part_kernels(args.numel)
    elif args.part == "offload":
        lines, rows = part_offload(db, sizes, args.steps)
    elif args.part == "breakdown":
        lines, rows = part_breakdown(sizes, args.device)
    else:
        lines, rows = part_quality(db, args.quality_size, args.quality_steps)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    text = "\n".join([f"## compress / offload: {args.part} ({gpu}, torch {torch.__version__})\n",
                      *lines, ""])
    (args.out / f"compress-{args.part}.md").write_text(text)
    (args.out / f"compress-{args.part}.json").write_text(json.dumps(rows, indent=1, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
