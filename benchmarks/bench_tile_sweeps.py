"""Where tiling's time goes: forward + backward of the U-Net alone, tiled layouts side by side.

One process, one GPU, one size (default 4188, padded to 4192), batch 1, bf16 autocast,
channels_last and cudnn.benchmark (as memstudy's tuned runs), a random input and a plain
squared-output loss (no optimizer, no data, no meters: the model's own cost). For the untiled
model and each tiled layout (tile count x keep x levels) it reports the median forward +
backward time over --repeat timed steps after --warmup untimed ones (CUDA events), its ratio to
the untiled step, and the allocator peak above the model's own memory. With --profile, the
top CUDA kernels of one step of the last layout go to --out/tile-sweeps-profile.txt.
These figures isolate the tiled levels' recomputation; whole training steps (data, loss,
optimizer, meters, budget) are bench_ladder's / bench_tile's runs.

    python benchmarks/bench_tile_sweeps.py --out gpu-out/results --size 4188 --tiles 8,16
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import median_ms  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=4188)
    p.add_argument("--tiles", default="8,16")
    p.add_argument("--keeps", default="none,conv1")
    p.add_argument("--levels", default="2")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    return p.parse_args(argv)


def layouts(args) -> list[dict | None]:
    found: list[dict | None] = [None]
    for levels in (int(v) for v in args.levels.split(",")):
        for keep in args.keeps.split(","):
            found += [{"levels": levels, "tiles": int(t), "keep": keep}
                      for t in args.tiles.split(",")]
    return found


def step_fn(layout: dict | None, size: int):
    from memstudy.models import build_unet
    from memstudy.tiling.tiled_forward import TiledForward

    model = build_unet(seed=0).cuda().to(memory_format=torch.channels_last).train()
    if layout:
        model.forward_padded = TiledForward(model, **layout)
    x = torch.rand(1, 1, size, size, device="cuda").to(memory_format=torch.channels_last)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().mean().backward()
    return model, step


def measure(layout, args) -> tuple[float, float]:
    torch.cuda.empty_cache()
    model, step = step_fn(layout, args.size)
    base = torch.cuda.memory_allocated()
    ms = median_ms(step, repeat=args.repeat, warmup=args.warmup)
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    del model, step
    return ms, peak_mb


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cudnn.benchmark = True
    lines = [f"# Tiled layouts, forward + backward at {args.size} px on "
             f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})", "",
             "| layout | ms | / untiled | peak MB above the model |", "|---|---|---|---|"]
    base_ms = None
    for layout in layouts(args):
        name = "untiled" if layout is None else \
            f"levels={layout['levels']} tiles={layout['tiles']} keep={layout['keep']}"
        try:
            ms, peak = measure(layout, args)
        except torch.OutOfMemoryError:
            lines.append(f"| {name} | out of memory | | |")
            continue
        base_ms = base_ms or ms
        lines.append(f"| {name} | {ms:.1f} | {ms / base_ms:.2f} | {peak:.0f} |")
        print(lines[-1], flush=True)
    (out / "tile-sweeps.md").write_text("\n".join(lines) + "\n")
    if args.profile:
        _, step = step_fn(layouts(args)[-1], args.size)
        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        averages = prof.key_averages()
        for key in ("self_device_time_total", "self_cuda_time_total"):  # newer / older torch
            try:
                text = averages.table(sort_by=key, row_limit=25)
                break
            except (AttributeError, KeyError, ValueError):
                continue
        (out / "tile-sweeps-profile.txt").write_text(text)


if __name__ == "__main__":
    main()
