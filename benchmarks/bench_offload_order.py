"""What `offload:which=boundaries` moves to the host in one training step, in the order the
forward saves it, at a target image size: so which tensors `offload:hold=N` keeps on the device
(the last N) and how many bytes each way the bus carries.

    python benchmarks/bench_offload_order.py --size 4188 --techniques amp:bf16,checkpoint,tile:3:keep=all

The step runs on the CPU at a proxy size (default 512 px) with offload's own pack / unpack
(memstudy/techniques/offload.py) and the run's other techniques, autocast included, so every
saved tensor has the dtype and layout it has on a GPU. Every tensor the U-Net saves is its
image size times a fixed factor per level, so the shapes and bytes at the target size are the
proxy's scaled exactly (both padded to the U-Net's stride: 4188 -> 4192 = 131 x 32, 512 =
16 x 32). Offload's threshold (`min_bytes`) is applied at the target size. The second of two
steps is recorded, as `hold` counts from the forward before. Not for `tile:stream`, whose
host boundaries a CPU step cannot tell from the device's.
"""
from __future__ import annotations

import argparse
import math
import sys
from fractions import Fraction
from pathlib import Path

import torch

from memstudy.config import RunConfig, set_value, split_techniques
from memstudy.errors import ConfigError
from memstudy.models.unet import STRIDE, padding_for
from memstudy.techniques.compose import build_pipeline, make_plan
from memstudy.techniques.offload import Offloader
from memstudy.techniques.options import OffloadOptions

MIB = 1 << 20
DEFAULT_MIN_BYTES = OffloadOptions().min_bytes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=4188, help="target square side, px")
    p.add_argument("--proxy", type=int, default=512, help="the side the CPU step runs at, px")
    p.add_argument("--techniques", default="amp:bf16,checkpoint,tile:3:keep=all",
                   help="the run's techniques but offload (tile with its strips given)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting, as memstudy run's --set (e.g. model.encoder=resnet50)")
    p.add_argument("--out", type=Path, help="folder for offload-order.md (else stdout only)")
    return p.parse_args(argv)


def padded(side: int) -> int:
    return side + padding_for(side, side)[0]


def proxy_config(args: argparse.Namespace) -> RunConfig:
    cfg = RunConfig(techniques=split_techniques(args.techniques))
    cfg.train.image_size, cfg.train.device = args.proxy, "cpu"
    for assignment in args.settings:
        set_value(cfg, assignment)
    return cfg


def saved_in_order(cfg: RunConfig, scale: Fraction) -> list[torch.Tensor]:
    """The tensors offload copies to the host in the second step's forward at the proxy size,
    in order (meta tensors with their shapes, dtypes and strides), with offload's default
    threshold applied at the target size, `scale` times the proxy's side."""
    min_bytes = int(DEFAULT_MIN_BYTES / (scale * scale))
    plan = make_plan(cfg)
    if plan.has("tile") and plan.chosen["tile"].stream:
        raise ConfigError("tile:stream keeps its boundaries in host memory itself and offload "
                          "leaves them there; a CPU step cannot tell them from the device's, so "
                          "this count would include them: drop stream=true")
    build = build_pipeline(plan)
    offloader = Offloader(torch.device("cpu"), torch.device("cpu"), min_bytes=min_bytes,
                          boundaries_only=True)
    copied: list[torch.Tensor] = []
    copy_to_host = offloader._copy_to_host

    def recording(t: torch.Tensor, uses: int = 1) -> torch.Tensor:
        copied.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
        return copy_to_host(t, uses)

    offloader._copy_to_host = recording
    runtime = build.runtime
    runtime.transform_order["offload"] = len(runtime.transform_order)  # after every other
    runtime.add_saved_tensor_transform(offloader.pack, offloader.unpack, owner="offload")
    side = cfg.train.image_size
    channels = cfg.model.in_channels
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(1, channels, side, side, generator=gen)
    y = (torch.rand(1, 1, side, side, generator=gen) > 0.5).float()
    for _ in range(2):
        copied.clear()
        with runtime.forward_context():
            loss = runtime.forward(build.model, x, y)
        runtime.backward(loss)
    return copied


def at_target(copied: list[torch.Tensor], scale: Fraction) -> list[tuple[tuple[int, ...], str, int]]:
    """(shape, dtype, bytes) of each copied tensor at the target size: its rows and columns
    times `scale` (exact integers for sides on the stride)."""
    scaled = []
    for t in copied:
        shape = (*t.shape[:-2], *(int(side * scale) for side in t.shape[-2:]))
        assert all(side * scale == int(side * scale) for side in t.shape[-2:]), (t.shape, scale)
        scaled.append((shape, str(t.dtype).removeprefix("torch."),
                       math.prod(shape) * t.element_size()))
    return scaled


def table(scaled: list[tuple[tuple[int, ...], str, int]], args: argparse.Namespace) -> str:
    rows, kept = [], 0
    for hold, (shape, dtype, nbytes) in enumerate(reversed(scaled), start=1):
        kept += nbytes
        rows.append(f"| {len(scaled) - hold + 1} | {'x'.join(map(str, shape))} | {dtype} | "
                    f"{nbytes / MIB:.0f} | {hold} | {kept / MIB:.0f} |")
    total = sum(nbytes for *_, nbytes in scaled) / MIB
    head = [f"# What offload:which=boundaries moves at {args.size} px ({padded(args.size)} padded)",
            "", f"Techniques: `{args.techniques}` + offload{''.join(', ' + s for s in args.settings)}; "
            f"computed on the CPU at {args.proxy} px and scaled (benchmarks/bench_offload_order.py). "
            f"**{len(scaled)} tensors, {total:.0f} MiB each way per step.** `hold=N` keeps the "
            "last N saved on the device (the first the backward brings back).", "",
            "| saved | shape at the target | dtype | MiB | hold=N keeps it | kept by hold=N, MiB |",
            "|---|---|---|---|---|---|"]
    return "\n".join(head + rows[::-1]) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if padded(args.proxy) != args.proxy:
        sys.exit(f"--proxy {args.proxy} is no multiple of the U-Net's stride {STRIDE}; use "
                 f"{padded(args.proxy)}")
    scale = Fraction(padded(args.size), args.proxy)
    try:
        copied = saved_in_order(proxy_config(args), scale)
    except ConfigError as error:  # a bad technique, setting or size: one line, no traceback
        sys.exit(f"bench_offload_order: {error}")
    text = table(at_target(copied, scale), args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "offload-order.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
