"""Fused per-unit gradient statistics (Triton) vs PyTorch: GPU benchmark, run by the lead.

    python benchmarks/bench_kernels.py --out benchmarks/results/h100/kernels

Gradients shaped like the U-Net/ResNet-34's parameters (24.4 M), grouped into its 11
Tri-Accel units (or into one segment per parameter tensor, --per-tensor). Timed with CUDA
events after warm-up, median of --repeat launches:
  loop      a Python loop, one torch.var_mean per unit over that unit's concatenated grads
  ref_flat  the reference: one torch.var_mean per segment of the flat buffer
  fused     flatten (one torch.cat) + the two Triton launches (what the controller runs)
  kernel    the Triton launches alone, on an already flat buffer
Writes kernels.md and prints the table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from memstudy.techniques.tri_accel.grad_stats import (flatten, make_layout, segment_stats,
                                                   segment_stats_reference)
from memstudy.models import build_unet
from memstudy.techniques.tri_accel.control_units import unet_units
from cuda_timing import median_ms  # benchmarks/ is on sys.path when run as a script


def timed(fn, repeat: int) -> float:
    return median_ms(fn, repeat)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--per-tensor", action="store_true", help="one segment per parameter tensor")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU")
    model = build_unet()
    g = torch.Generator(device="cuda").manual_seed(0)
    groups = ([[p] for u in unet_units(model) for p in u.parameters()] if args.per_tensor
              else [u.parameters() for u in unet_units(model)])
    grads = [[torch.randn(p.shape, device="cuda", generator=g) * 1e-3 for p in grp] for grp in groups]
    sizes = [sum(t.numel() for t in grp) for grp in grads]
    all_grads = [t for grp in grads for t in grp]
    layout = make_layout(sizes, "cuda")
    offsets = layout.offsets.tolist()
    flat = flatten(all_grads)
    mean, var = segment_stats(flat, layout)
    ref_mean, ref_var = segment_stats_reference(flat, offsets)
    torch.testing.assert_close(var, ref_var, rtol=1e-4, atol=1e-12)
    results = {
        "loop": timed(lambda: [torch.var_mean(flatten(grp), correction=0) for grp in grads], args.repeat),
        "ref_flat": timed(lambda: segment_stats_reference(flat, offsets), args.repeat),
        "fused": timed(lambda: segment_stats(flatten(all_grads), layout), args.repeat),
        "kernel": timed(lambda: segment_stats(flat, layout), args.repeat),
    }
    gpu = torch.cuda.get_device_name()
    lines = [f"# Per-unit gradient statistics ({gpu})", "",
             f"{sum(sizes) / 1e6:.1f} M elements in {len(sizes)} segments, torch {torch.__version__}, "
             f"median of {args.repeat} (ms, CUDA events)", "",
             "| method | ms | speedup vs loop |", "|---|---|---|"]
    lines += [f"| {k} | {v:.3f} | {results['loop'] / v:.2f}x |" for k, v in results.items()]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    name = "kernels_per_tensor.md" if args.per_tensor else "kernels.md"
    (args.out / name).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
