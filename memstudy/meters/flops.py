"""Model FLOPs of one training step, and the pixel counts that throughput figures use.

Counted once per (batch, size) by torch.utils.flop_counter on the meta device: shapes only,
no memory, no compute. These are *model* FLOPs (forward + backward of the plain U-Net), the
MFU convention: recomputation by checkpointing or invertible blocks is work the technique
adds, not useful work, so it is not counted. The network runs on the input padded to a
multiple of 32 (models/unet.py), so the count is that of the padded size: padding is work
the GPU does. Throughput in pixels/s counts the image's own (real) pixels only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from memstudy.models import UNet
from memstudy.models.unet import padding_for


@functools.lru_cache(maxsize=64)
def model_flops_per_step(batch_size: int, image_size: int | tuple[int, int]) -> int:
    """FLOPs of forward + backward at a side (square) or (height, width), padding included."""
    height, width = image_size if isinstance(image_size, tuple) else (image_size, image_size)
    with torch.device("meta"):  # no weights initialised on the CPU (a second a cell there)
        model = UNet()
    model = model.to("meta")  # the one weight smp makes on the CPU (the 1-channel conv1)
    x = torch.empty(batch_size, 1, height, width, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops()


@dataclass(frozen=True)
class PixelCount:
    """Pixels of the training images as the harness counts them (docs/metrics.md)."""
    real_per_image: float  # mean over training images of height x width
    padded_per_image: float  # the same after padding to multiples of 32
    pad_rows: int  # most rows added at the bottom of any image
    pad_cols: int  # most columns added at the right of any image

    @property
    def padding_ratio(self) -> float:
        return self.padded_per_image / self.real_per_image

    def figures(self, batch_size: int) -> dict[str, float]:
        return {"real_px_per_step": batch_size * self.real_per_image,
                "padded_px_per_step": batch_size * self.padded_per_image,
                "padding_ratio": self.padding_ratio,
                "pad_bottom_px": self.pad_rows, "pad_right_px": self.pad_cols}


def pixel_count(shapes: list[tuple[int, int]]) -> PixelCount:
    pads = [padding_for(h, w) for h, w in shapes]
    real = sum(h * w for h, w in shapes) / len(shapes)
    padded = sum((h + r) * (w + c) for (h, w), (r, c) in zip(shapes, pads)) / len(shapes)
    return PixelCount(real, padded, max(r for r, _ in pads), max(c for _, c in pads))

