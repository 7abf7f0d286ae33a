"""Diagnosis: every copy, cast and layout-sensitive op of one tiled training step, with dtypes,
layouts, shapes and the tile sweep it belongs to.

    python benchmarks/diag_tile_copies.py 2048 3 convs conv1 > copies.txt   # size levels layer1 keep

A TorchDispatchMode records each `_to_copy`, `clone`, `copy_`, `contiguous`, convolution (and its
backward), `cat` and up-sampling op of the second of two steps (bf16 autocast, channels_last,
4 strips; CUDA when there is a GPU), keyed by (tile sweep, op, inputs, output, the three ops
before it). Rows print as "count | sweep | op | inputs | output | preceding ops"; a tensor
prints as dtype:layout:[shape] (CL = channels_last strides). What it found on an H100 is in
docs/techniques/tile.md ("Measured"): casts to float32 around every up-sampling under autocast
(`diag-2048-copies-before-fold.txt`), which the folded up-convolution removed from the tiles.
"""
from __future__ import annotations

import collections
import contextlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memstudy.models import build_unet
from memstudy.tiling import sweep as sweep_module
from memstudy.tiling.tiled_forward import TiledForward

RECORDED = {"_to_copy", "clone", "copy_", "contiguous", "convolution", "convolution_backward",
            "cat", "upsample_nearest2d", "upsample_nearest2d_backward"}


class Copies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.rows: collections.Counter = collections.Counter()
        self.sweep = ["-"]  # the tile sweep running now (memstudy.tiling.sweep.label)
        self.previous = ["-"] * 3

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in RECORDED:
            first = out[0] if isinstance(out, (tuple, list)) else out
            inputs = " ".join(_describe(a) for a in args if isinstance(a, torch.Tensor))
            self.rows[(self.sweep[-1], name, inputs, _describe(first),
                       ">".join(self.previous))] += 1
        self.previous = self.previous[1:] + [name]
        return out


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return "-"
    dtype = str(t.dtype).removeprefix("torch.")
    if t.dim() != 4:
        return f"{dtype}{list(t.shape)}"
    s = t.stride()
    layout = "CL" if s[1] == 1 and t.shape[1] > 1 else ("NCHW" if s[-1] == 1 else f"strides{s}")
    return f"{dtype}:{layout}:{list(t.shape)}"


def main(argv: list[str]) -> None:
    size, levels, layer1, keep = int(argv[0]), int(argv[1]), argv[2], argv[3]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_unet(seed=0).to(device).train().to(memory_format=torch.channels_last)
    model.forward_padded = TiledForward(model, levels=levels, tiles=4, keep=keep, layer1=layer1)
    x = torch.rand(1, 1, size, size, device=device)
    label = sweep_module.label
    for _ in range(2):  # the second step, after cuDNN's choices
        record = Copies()

        @contextlib.contextmanager
        def named(region, sweep, record=record):
            record.sweep.append(f"{region.name}:{sweep}")
            try:
                with label(region, sweep):
                    yield
            finally:
                record.sweep.pop()

        sweep_module.label = named
        try:
            with record:
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = model(x).float().square().mean()
                loss.backward()
        finally:
            sweep_module.label = label
    for key, count in sorted(record.rows.items()):
        print(count, " | ".join(key))


if __name__ == "__main__":
    main(sys.argv[1:])
