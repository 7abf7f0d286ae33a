"""FLOPs of one training step (forward + backward) per technique set, over the plain step's:
where a memory technique's extra GPU work comes from, counted, not timed.

torch.utils.flop_counter counts the matrix work (convolutions, transposed convolutions, matrix
products) by shape, so the counts are the same on any device and at any speed; BatchNorm,
ReLU, copies and other memory-bound work count nothing. The default U-Net (ResNet-34),
batch 1, on the CPU. Sizes scale the study's: 1040 px with 208-row strips is 4160 px with
832-row strips (tile:auto's 5 strips at 4188 px under 4 GiB) at a sixteenth of the pixels.

    python benchmarks/bench_step_flops.py --out benchmarks/results/cpu/step-flops
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

SETS = ["checkpoint", "tile:rows={rows}:keep=all", "checkpoint,tile:rows={rows}:keep=all",
        "checkpoint,tile:rows={rows}:keep=half", "checkpoint,tile:rows={rows}:keep=bn",
        "checkpoint:selective,tile:rows={rows}:keep=all"]


def step_flops(techniques: list[str], size: int) -> int:
    from memstudy.config import RunConfig
    from memstudy.techniques.compose import build_pipeline, make_plan

    cfg = RunConfig(techniques=techniques)
    cfg.train.image_size, cfg.train.device = size, "cpu"
    model = build_pipeline(make_plan(cfg)).model.train()
    x = torch.rand(1, 1, size, size, generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=1040)
    p.add_argument("--rows", type=int, default=208)
    args = p.parse_args(argv)
    plain = step_flops([], args.size)
    lines = [f"| plain (no technique) | {plain / 1e9:.1f} | 1.000 |"]
    for entry in SETS:
        techniques = entry.format(rows=args.rows).split(",")
        flops = step_flops(techniques, args.size)
        lines.append(f"| `{','.join(techniques)}` | {flops / 1e9:.1f} | {flops / plain:.3f} |")
        print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step-flops.md").write_text(
        f"# FLOPs of one training step over the plain step's ({args.size} px, "
        f"{args.rows}-row strips)\n\nResNet-34 U-Net, batch 1, forward + backward, "
        "torch.utils.flop_counter (matrix work only; benchmarks/bench_step_flops.py).\n\n"
        "| set | GFLOP | / plain |\n|---|---|---|\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
