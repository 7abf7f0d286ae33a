"""FLOPs of one training step (forward + backward) per technique set, over the plain step's:
where a memory technique's extra GPU work comes from, counted, not timed; beside them the bytes
its forward saves for backward under bf16 autocast (what `offload:which=all` would move to the
host and back), also set by shapes alone.

torch.utils.flop_counter counts the matrix work (convolutions, transposed convolutions, matrix
products) by shape, so the counts are the same on any device and at any speed; BatchNorm,
ReLU, copies and other memory-bound work count nothing. The default U-Net (ResNet-34),
batch 1, on the CPU. Sizes scale the study's: 1040 px with 208-row strips is 4160 px with
832-row strips (tile:auto's 5 strips at 4188 px under 4 GiB) at a sixteenth of the pixels.

`PARTIAL_MODULES` in a set's name: bench_ladder.PARTIAL_MODULES, the blocks PARTIAL_SET
recomputes (layer1-3 and decoder blocks 1-2; layer4 and decoder block 0 stay saved).

    python benchmarks/bench_step_flops.py --out benchmarks/results/cpu/step-flops
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench_ladder import PARTIAL_MODULES  # noqa: E402 (benchmarks/ is this script's folder)

SETS = ["checkpoint", "tile:rows={rows}:keep=all", "checkpoint,tile:rows={rows}:keep=all",
        "checkpoint,tile:rows={rows}:keep=half", "checkpoint,tile:rows={rows}:keep=bn",
        "checkpoint:selective,tile:rows={rows}:keep=all",
        f"checkpoint:modules:modules={PARTIAL_MODULES},tile:rows={{rows}}:keep=all"]


def _model(techniques: list[str], size: int) -> torch.nn.Module:
    from memstudy.config import RunConfig
    from memstudy.techniques.compose import build_pipeline, make_plan

    cfg = RunConfig(techniques=techniques)
    cfg.train.image_size, cfg.train.device = size, "cpu"
    return build_pipeline(make_plan(cfg)).model.train()


def _image(size: int) -> torch.Tensor:
    return torch.rand(1, 1, size, size, generator=torch.Generator().manual_seed(0))


def step_flops(techniques: list[str], size: int) -> int:
    with FlopCounterMode(display=False) as counter:
        _model(techniques, size)(_image(size)).sum().backward()
    return counter.get_total_flops()


def saved_bytes(techniques: list[str], size: int) -> int:
    """Bytes of the distinct storages the forward saves for backward, under bf16 autocast
    (checkpoint's regions save through the same hooks: respect_saved_tensors_hooks)."""
    from memstudy.meters import unique_storage_bytes

    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    model, x = _model(techniques, size), _image(size)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    return unique_storage_bytes(saved)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=1040)
    p.add_argument("--rows", type=int, default=208)
    args = p.parse_args(argv)
    plain = step_flops([], args.size)
    lines = []
    for entry in ["", *SETS]:
        techniques = [t for t in entry.format(rows=args.rows).split(",") if t]
        flops = plain if not techniques else step_flops(techniques, args.size)
        name = (f"`{','.join(techniques)}`".replace(PARTIAL_MODULES, "PARTIAL_MODULES")
                if techniques else "plain (no technique)")
        lines.append(f"| {name} | {flops / 1e9:.1f} | {flops / plain:.3f} | "
                     f"{saved_bytes(techniques, args.size) / 2**20:.1f} |")
        print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step-flops.md").write_text(
        f"# FLOPs of one training step over the plain step's ({args.size} px, "
        f"{args.rows}-row strips)\n\nResNet-34 U-Net, batch 1, forward + backward, "
        "torch.utils.flop_counter (matrix work only; benchmarks/bench_step_flops.py).\n\n"
        "| set | GFLOP | / plain | saved for backward under bf16 autocast, MiB |\n"
        "|---|---|---|---|\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
