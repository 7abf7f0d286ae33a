"""What `tile:stream` moves between host and device in one training step, region by region, at a
target image size: the bytes its copies carry each way, against which a streamed step's time
can be read (at the link's rate, how long the copies alone take).

    python benchmarks/bench_stream_traffic.py --height 16384 --width 16384 --rows 784 \
        --variants conv1:convs:752,conv1:blocks:752,conv1:whole:784

The step runs on the CPU at the target's height and a narrow proxy width (default 64 px):
strips are full-width, so every strip, halo and sweep is the target's, and every tensor the
copies carry is its width times a fixed factor per level, so the bytes at the target width are
the proxy's scaled exactly (both multiples of the U-Net's stride). A tensor is counted where a
GPU run would copy it: an input strip of a host boundary or of the image (streaming.fetch in
the sweeps), a tile's owned rows of a host output (write_rows), a host output gradient's rows
(the seed's fetch), and a host input gradient's rows read back to be added to and written out
(add_rows, write_rows). Bytes per element as on a GPU under amp:bf16: 2 for the boundaries and
their gradients, 4 for the image (the batches are float32). The chunked loss's blocks of the
target are left out (one read of the 4-byte target forward, one in backward's recomputation).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch

from memstudy.models import build_unet
from memstudy.models.unet import STRIDE
from memstudy.tiling import sweep as sweep_module
from memstudy.tiling.tiled_forward import TiledForward

GIB = 1 << 30
LINK_GB_S = 55.0  # the H200's PCIe rate offload measured (docs/techniques/tile.md)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--height", type=int, default=16384, help="target image height, px")
    p.add_argument("--width", type=int, default=16384, help="target image width, px")
    p.add_argument("--proxy-width", type=int, default=64, help="the width the CPU step runs at")
    p.add_argument("--rows", type=int, default=784, help="strip rows at full resolution "
                   "(tile:auto's at 16384 px under 8 GiB)")
    p.add_argument("--levels", type=int, default=4)
    p.add_argument("--layer1", default="blocks")  # tile:auto's streamed plan
    p.add_argument("--keep", default="conv1")
    p.add_argument("--variants", default="", help="more plans to total beside it, comma-"
                   "separated keep:layer1:rows (e.g. conv1:blocks:752)")
    p.add_argument("--out", type=Path, help="folder for stream-traffic.md (else stdout only)")
    args = p.parse_args(argv)
    try:
        args.variants = [(k, l, int(r)) for k, l, r in
                         (v.split(":") for v in args.variants.split(",") if v)]
    except ValueError:
        p.error(f"--variants {args.variants!r}: give keep:layer1:rows, comma-separated")
    for name in ("height", "width", "proxy_width"):
        if getattr(args, name) % STRIDE:
            p.error(f"--{name.replace('_', '-')} must be a multiple of {STRIDE} (the U-Net's "
                    "stride), so that every level's width scales exactly")
    return args


class Ledger:
    """Bytes per (region, kind of host tensor, direction), counted from the proxy step's host
    tensors: kinds `image`, `boundary` (a host region output) and `gradient` (a host input's)."""

    def __init__(self):
        self.host: dict[int, tuple[int, str]] = {}  # storage data_ptr -> (bytes/element, kind)
        self.kept: list[torch.Tensor] = []  # the marked tensors, alive: no address reused
        self.moved: dict[tuple[str, str, str], float] = defaultdict(float)
        # of `moved` to the device, per region: a host input gradient's rows read back to be
        # added to (add_rows), read as the tile's gradient is ready, not a tile ahead
        self.added: dict[str, float] = defaultdict(float)
        self.region = "?"

    def mark(self, t: torch.Tensor, element: int, kind: str) -> torch.Tensor:
        self.host[t.untyped_storage().data_ptr()] = (element, kind)
        self.kept.append(t)
        return t

    def known(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.host

    def count(self, t: torch.Tensor, direction: str) -> int:
        """Counts `t` if it is a host tensor of the step; the bytes counted (0 if not)."""
        found = self.host.get(t.untyped_storage().data_ptr())
        if found is None:
            return 0
        element, kind = found
        self.moved[(self.region, kind, direction)] += t.numel() * element
        return t.numel() * element

    def count_added(self, t: torch.Tensor) -> None:
        """Rows read back to be added to, then written out again."""
        self.added[self.region] += self.count(t, "to device")
        self.count(t, "to host")


@contextlib.contextmanager
def instrumented(ledger: Ledger):
    """The sweeps' copy points wrapped while inside, so that the ledger sees each host tensor
    they touch, and the region of every sweep (forward and backward: each goes through
    tile_strips)."""
    def wrap(name: str, before):
        inner = getattr(sweep_module, name)

        def wrapped(*a, **k):
            before(*a)
            return inner(*a, **k)
        return mock.patch.object(sweep_module, name, wrapped)

    def added_to(full, lo, hi, *_):
        ledger.count_added(full[..., lo:hi, :])

    full_like, grad_of = sweep_module._full_like, sweep_module.Sweep.input_grad

    def marked(part, inputs, sw):
        out = full_like(part, inputs, sw)
        return ledger.mark(out, 2, "boundary") if sw.host else out

    def input_grad(self, i, like):
        made = self.input_grads[i] is None
        grad = grad_of(self, i, like)
        if made and ledger.known(like):
            ledger.mark(grad, 2, "gradient")
        return grad

    def named(sweep, *_):
        ledger.region = sweep.region.name

    with contextlib.ExitStack() as stack:
        stack.enter_context(wrap("fetch", lambda t, *_: ledger.count(t, "to device")))
        stack.enter_context(wrap("write_rows", lambda rows, *_: ledger.count(rows, "to host")))
        stack.enter_context(wrap("add_rows", added_to))
        stack.enter_context(wrap("tile_strips", named))
        stack.enter_context(mock.patch.object(sweep_module, "_full_like", marked))
        stack.enter_context(mock.patch.object(sweep_module.Sweep, "input_grad", input_grad))
        yield


def traffic(args: argparse.Namespace, keep: str, layer1: str, rows: int) -> Ledger:
    torch.manual_seed(0)
    unet = build_unet(seed=0).train()
    unet.forward_padded = TiledForward(unet, args.levels, 0, rows, keep, None, layer1, "torch",
                                       stream=True)
    ledger = Ledger()
    with instrumented(ledger):
        x = ledger.mark(torch.rand(1, 1, args.height, args.proxy_width,
                                   generator=torch.Generator().manual_seed(1)), 4, "image")
        unet(x).square().mean().backward()
    return ledger


def by_region(args: argparse.Namespace, ledger: Ledger) -> dict[str, list[float]]:
    """Bytes [to the device, to the host] per region, at the target width."""
    scale = args.width / args.proxy_width
    found: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for (region, _kind, direction), n in ledger.moved.items():
        found[region][direction == "to host"] += n * scale
    return found


def seconds(n: float) -> str:
    return f"{n / 1e9 / LINK_GB_S:.2f}"


def page(args: argparse.Namespace) -> str:
    plans = [(args.keep, args.layer1, args.rows), *args.variants]
    totals = []
    for keep, layer1, rows in plans:
        ledger = traffic(args, keep, layer1, rows)
        regions = by_region(args, ledger)
        totals.append((keep, layer1, rows, regions,
                       sum(v[0] for v in regions.values()), sum(v[1] for v in regions.values()),
                       sum(ledger.added.values()) * args.width / args.proxy_width))
    lines = [f"# What tile:stream copies in one training step at {args.height} x {args.width} px",
             "",
             f"ResNet-34 U-Net, batch 1, `tile:rows=R:levels={args.levels}:keep=K:layer1=L:"
             "stream=true`; bytes as under amp:bf16 (2 per element, the image 4), counted in a "
             f"CPU step of the target's height and {args.proxy_width} px wide and scaled by the "
             "width (benchmarks/bench_stream_traffic.py); seconds at "
             f"{LINK_GB_S:.0f} GB/s, the H200's PCIe rate that offload measured. The chunked "
             "loss's reads of the target are not counted.", "",
             "| keep | layer1 | strip rows | to device GiB | to host GiB | s to the device | "
             "s to the host |", "|---|---|---|---|---|---|---|"]
    for keep, layer1, rows, _regions, h2d, d2h, _added in totals:
        lines.append(f"| {keep} | {layer1} | {rows} | {h2d / GIB:.1f} | {d2h / GIB:.1f} | "
                     f"{seconds(h2d)} | {seconds(d2h)} |")
    keep, layer1, rows, regions, h2d, d2h, added = totals[0]
    lines += ["", f"By region, `keep={keep}:layer1={layer1}`, {rows}-row strips:", "",
              "| region | to device GiB | to host GiB |", "|---|---|---|"]
    for region, (to_dev, to_host) in regions.items():
        lines.append(f"| {region} | {to_dev / GIB:.2f} | {to_host / GIB:.2f} |")
    lines += [f"| **all** | **{h2d / GIB:.2f}** | **{d2h / GIB:.2f}** |", "",
              f"Of the {h2d / GIB:.1f} GiB to the device, {added / GIB:.1f} GiB ({seconds(added)} s) "
              "are a host input gradient's rows read back to be added to (add_rows): read as "
              "the tile's gradient is ready, in the compute stream's order, not a tile ahead "
              "(tile:ahead brings the strips and output-gradient rows ahead, the rest).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = page(args)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "stream-traffic.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
