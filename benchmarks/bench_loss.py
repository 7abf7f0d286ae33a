"""The MS-SSIM loss's time and memory: pytorch-msssim's own autograd against the chunked loss.

    python benchmarks/bench_loss.py --out gpu-out/results/loss [--sizes 2048 4188]
        [--rows 0 256 512 1024 2048] [--step-size 4188] [--steps 16]

memstudy computes 1 - MS-SSIM in row blocks by default (`train.loss_chunk_rows = 256`,
memstudy/msssim_chunked.py): it saves one gradient map per scale (4/3 of an image), where
pytorch-msssim saves about a dozen full-resolution maps (978 MB at 4188 px, H100, 2026-11-22), but it
launches the kernels of every block separately (and, until 2026-11-23, ran every block's
filters twice). bench_overhead times memstudy with `loss_chunk_rows = 0`, the loop's loss;
this benchmark measures what the default costs.

Part `loss`: the loss alone, forward + backward of 1 - MS-SSIM (5 scales, float32, one image)
on a random target and a prediction correlated with it (0.9 target + 0.1 noise) at each
--sizes, for each --rows (0 = pytorch-msssim): median milliseconds of 20 calls after 5 (CUDA
events, benchmarks/cuda_timing.py) and the peak allocated above the two inputs and their
gradient.

Part `step`: memstudy's plain step (memstudy.runner.execute, amp:bf16, the tuned baseline's
settings, one phantom, --steps timed steps after 2 warm-up and 1 metered) at --step-size with
loss_chunk_rows 0 and 256, in one process, each run primed once first (benchmarks/priming.py),
so neither carries cuDNN autotuning.

Writes loss.md and loss.json into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from cuda_timing import median_ms  # benchmarks/ is on sys.path when run as a script
from memstudy.byte_sizes import MB
from priming import prime


def loss_row(size: int, rows: int) -> dict:
    from memstudy.quality import msssim, msssim_weights

    gen = torch.Generator(device="cuda").manual_seed(0)
    target = torch.rand(1, 1, size, size, device="cuda", generator=gen)
    # correlated with the target, as a trained network's output is: on independent noise every
    # scale's contrast-structure term is ~0, clamped by MS-SSIM's relu, and backward does no work
    noise = torch.rand(1, 1, size, size, device="cuda", generator=gen)
    pred = (0.9 * target + 0.1 * noise).requires_grad_()
    weights = msssim_weights(5)

    def step():
        pred.grad = None
        (1 - msssim(pred, target, weights, rows)).backward()

    step()  # the gradient buffer exists before the peak is read
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = median_ms(step)
    return {"size": size, "rows": rows, "ms": ms, "peak_bytes": peak}


def step_rows(size: int, steps: int, cache_dir: str) -> list[dict]:
    """bench_overhead's memstudy run of amp:bf16 (2 warm-up steps) with each loss, primed."""
    from bench_overhead import measure, timed_config

    configs = []
    for rows in (0, 256):
        cfg = timed_config(size, ["amp:bf16"], 2, steps, cache_dir)
        cfg.train.loss_chunk_rows = rows
        configs.append(cfg)
    prime(configs)
    return [{"size": size, "rows": cfg.train.loss_chunk_rows, **measure(cfg)} for cfg in configs]


def markdown(loss: list[dict], steps: list[dict], gpu: str) -> str:
    lines = [f"# The MS-SSIM loss: pytorch-msssim vs chunked ({gpu})", "",
             f"torch {torch.__version__}; benchmarks/bench_loss.py. rows 0 = pytorch-msssim's own "
             "autograd; rows > 0 = memstudy's chunked loss (train.loss_chunk_rows; default 256).",
             "", "## The loss alone: forward + backward, float32, one image", "",
             "| px | rows | ms | peak above inputs MB |", "|---|---|---|---|"]
    lines += [f"| {r['size']} | {r['rows']} | {r['ms']:.2f} | {r['peak_bytes'] / MB:.0f} |" for r in loss]
    if steps:
        lines += ["", "## memstudy's plain step, amp:bf16 (primed, same process)", "",
                  "| px | loss_chunk_rows | step ms | peak alloc MB |", "|---|---|---|---|"]
        lines += [f"| {r['size']} | {r['rows']} | {r['step_time_s'] * 1e3:.1f} | "
                  f"{(r['peak_alloc_bytes'] or 0) / MB:.0f} |" for r in steps]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4188])
    p.add_argument("--rows", type=int, nargs="+", default=[0, 256, 512, 1024, 2048])
    p.add_argument("--parts", nargs="+", choices=("loss", "step"), default=["loss", "step"])
    p.add_argument("--step-size", type=int, default=4188)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_loss needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loss, steps = [], []
    if "loss" in args.parts:
        for size in args.sizes:
            for rows in args.rows:
                loss.append(loss_row(size, rows))
                print(f"{size} px rows {rows}: {loss[-1]['ms']:.2f} ms, "
                      f"{loss[-1]['peak_bytes'] / MB:.0f} MB", flush=True)
                torch.cuda.empty_cache()
    if "step" in args.parts:
        steps = step_rows(args.step_size, args.steps,
                          os.environ.get("MEMSTUDY_CACHE") or str(out / "phantoms"))
        for r in steps:
            print(f"step {r['size']} px rows {r['rows']}: {r['step_time_s'] * 1e3:.1f} ms", flush=True)
    gpu = torch.cuda.get_device_name(0)
    (out / "loss.json").write_text(json.dumps({"gpu": gpu, "torch": torch.__version__,
                                               "loss": loss, "steps": steps}, indent=1))
    text = markdown(loss, steps, gpu)
    (out / "loss.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
