"""Loss and image-quality figures: 1 - MS-SSIM for training, plus SSIM and PSNR for validation.

All images are in [0, 1] (data_range = 1). The loss is computed in float32 outside
autocast: MS-SSIM's products of small variances underflow in float16. By default it is
computed in row chunks (memstudy/msssim_chunked.py): pytorch-msssim's value and gradient
without its full-resolution maps, which at 4188 px saved ~1 GB for backward; with
train.loss_chunk_rows = 0 pytorch-msssim runs as it is, for comparison.

train.task = "segment" trains per-pixel classes instead: Dice + BCE or Dice + cross-entropy
(memstudy/segment_loss.py, chunked the same way), validated by Dice and IoU. `make_loss` is
the one place that picks the task's loss.
"""
from __future__ import annotations

import torch
from pytorch_msssim import ms_ssim, ssim

from memstudy.errors import ConfigError
from memstudy.msssim_chunked import chunked_msssim, chunked_ssim_and_msssim
from memstudy.segment_loss import dice_iou, segment_loss, segment_scores
from memstudy.image_sizes import size_hw
from memstudy.streaming import on_device

WIN_SIZE = 11  # pytorch-msssim's default Gaussian window
MSSSIM_WEIGHTS = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)  # Wang et al. 2003


def msssim_weights(scales: int) -> list[float]:
    w = MSSSIM_WEIGHTS[:scales]
    return [x / sum(w) for x in w]


def min_image_size(scales: int) -> int:
    """Smallest side the loss accepts. pytorch-msssim's ms_ssim asserts a side > (win - 1) * 2**4
    whatever the number of scales; one scale is plain SSIM, which needs one window."""
    return WIN_SIZE if scales == 1 else (WIN_SIZE - 1) * 2 ** 4 + 1


def check_image_size(size, scales: int, setting: str = "train.image_size") -> None:
    """Refuse a size whose smaller side is below the loss's minimum. `size` is a canonical size
    (memstudy.image_sizes) or a (height, width) pair; native sizes are checked per image, when read."""
    hw = size if isinstance(size, tuple) else size_hw(size)
    if hw is None:
        return
    need = min_image_size(scales)
    if min(hw) < need:
        ok = -(-need // 32) * 32
        shown = hw[0] if hw[0] == hw[1] else f"{hw[0]}x{hw[1]}"
        raise ConfigError(f"{setting} {shown} is too small for MS-SSIM with {scales} scales "
                          f"(window {WIN_SIZE}): the minimum is {need} px per side; use "
                          f"{setting} >= {ok} on each side or fewer train.msssim_scales")


SEGMENT_MIN_SIDE = 32  # the network's reflect padding to a multiple of 32 needs a side this long


def min_side(train) -> int:
    """The smallest image side train.task's loss accepts (`train` a TrainConfig): MS-SSIM's
    minimum for enhancement, SEGMENT_MIN_SIDE for segmentation (Dice and cross-entropy have
    no window)."""
    return SEGMENT_MIN_SIDE if train.task == "segment" else min_image_size(train.msssim_scales)


LOSS_CHUNK_ROWS = 256  # map rows per block of the chunked loss where no allocator cap is known
# float32 maps of one block row alive at once while the chunked loss runs a block (the five
# stacked inputs, their filtered maps, the SSIM terms and their gradients; an upper bound of
# the slope tests/test_loss_memory.py measures)
BLOCK_ROW_MAPS = 32
# the same for the segmentation loss, per output channel (the widened logits, probabilities,
# one-hot mask, cross-entropy terms and their gradients: 5-6 measured, tests/test_segment.py)
SEGMENT_ROW_MAPS = 8
AUTO_ROWS_GRAIN = 64  # auto block heights are multiples of this
AUTO_SHARE = 0.5  # of the memory left under the cap: the rest is the allocator's slack


class ObservedLoss(torch.nn.Module):
    """A loss computed in row blocks outside autocast, which tells observers when it runs.

    `observers`: objects told when a computation starts / ends and when its input's gradient
    is ready (meters/loss.py: the recorder's LossMeter subscribes during measured steps,
    through the run's Runtime.loss_observers, which is this list). chunk_rows: "auto"
    (auto_chunk_rows with the subclass's `row_maps`), a block height, or 0 (unchunked)."""

    row_maps = BLOCK_ROW_MAPS

    def __init__(self, chunk_rows: int | str = "auto", observers: list | None = None):
        super().__init__()
        self.chunk_rows = chunk_rows
        self.rows_used: set[int] = set()  # block heights chosen (recorded with the run)
        self.observers = [] if observers is None else observers

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        observers = list(self.observers)
        if observers and out.requires_grad:  # the model output's gradient: loss backward done
            out.register_hook(lambda grad: _notify(observers, "loss_backward_done"))
        _notify(observers, "loss_started")
        rows = auto_chunk_rows(out, self.row_maps) if self.chunk_rows == "auto" \
            else self.chunk_rows
        self.rows_used.add(rows)
        if not rows:  # unchunked: the whole target where the output is (a host one, tile:stream)
            target = target.to(out.device, non_blocking=True)
        try:
            with torch.autocast(out.device.type, enabled=False):
                return self.compute(out, target, rows)
        finally:
            _notify(observers, "loss_finished")

    def compute(self, out: torch.Tensor, target: torch.Tensor, rows: int) -> torch.Tensor:
        raise NotImplementedError


class MSSSIMLoss(ObservedLoss):
    """1 - MS-SSIM. chunk_rows > 0: the chunked computation (msssim_chunked.py: same value and
    gradient, the full-resolution maps never stored); 0: pytorch-msssim's own autograd."""

    def __init__(self, scales: int = 5, chunk_rows: int | str = "auto",
                 observers: list | None = None):
        super().__init__(chunk_rows, observers)
        self.weights = msssim_weights(scales)

    def compute(self, out: torch.Tensor, target: torch.Tensor, rows: int) -> torch.Tensor:
        return 1 - msssim(out.float(), target.float(), self.weights, rows)


class SegmentLoss(ObservedLoss):
    """Dice + BCE (classes = 1) or Dice + cross-entropy of logits against a mask of class
    indices (memstudy/segment_loss.py); chunk_rows > 0 in blocks, 0 with plain autograd."""

    row_maps = SEGMENT_ROW_MAPS

    def __init__(self, classes: int, chunk_rows: int | str = "auto",
                 observers: list | None = None):
        super().__init__(chunk_rows, observers)
        self.classes = classes

    def compute(self, out: torch.Tensor, target: torch.Tensor, rows: int) -> torch.Tensor:
        return segment_loss(out, target, self.classes, rows)


def make_loss(config, observers: list) -> ObservedLoss:
    """The training loss of `config` (a RunConfig): train.task picks it."""
    train = config.train
    if train.task == "segment":
        return SegmentLoss(config.model.classes, train.loss_chunk_rows, observers)
    return MSSSIMLoss(train.msssim_scales, train.loss_chunk_rows, observers)


def auto_chunk_rows(out: torch.Tensor, row_maps: int = BLOCK_ROW_MAPS) -> int:
    """The chunked loss's block height for `out`: the largest multiple of AUTO_ROWS_GRAIN
    rows (at most the image's) whose `row_maps` float32 maps per row and channel fit
    AUTO_SHARE of what the allocator may still allocate under its cap (a budget's, else the
    device's memory). Read from the allocator's host-side counters: no device sync. On the
    CPU (no cap) LOSS_CHUNK_ROWS."""
    if out.device.type != "cuda":
        return LOSS_CHUNK_ROWS
    batch, channels, height, width = out.shape
    index = out.device.index if out.device.index is not None else torch.cuda.current_device()
    cap = torch.cuda.get_per_process_memory_fraction(index) \
        * torch.cuda.get_device_properties(index).total_memory
    left = max(0.0, cap - torch.cuda.memory_allocated(index)) * AUTO_SHARE
    row_bytes = row_maps * 4 * batch * channels * width
    rows = int(left // row_bytes) // AUTO_ROWS_GRAIN * AUTO_ROWS_GRAIN
    return max(AUTO_ROWS_GRAIN, min(rows, -(-height // AUTO_ROWS_GRAIN) * AUTO_ROWS_GRAIN))


def _notify(observers: list, event: str) -> None:
    for observer in observers:
        getattr(observer, event)()


def msssim(out: torch.Tensor, target: torch.Tensor, weights: list[float],
           chunk_rows: int = 0) -> torch.Tensor:
    if chunk_rows:
        return chunked_msssim(out, target, weights, WIN_SIZE, chunk_rows)
    if len(weights) == 1:  # one scale is plain SSIM; pytorch-msssim's ms_ssim needs >= 2
        return ssim(out, target, data_range=1.0, win_size=WIN_SIZE)
    return ms_ssim(out, target, data_range=1.0, win_size=WIN_SIZE, weights=weights)


@torch.no_grad()
def quality(out: torch.Tensor, target: torch.Tensor, scales: int,
            chunk_rows: int = LOSS_CHUNK_ROWS) -> dict[str, float]:
    """Per-batch mean of the validation figures. chunk_rows > 0 computes loss and SSIM in one
    chunked pass (equal to pytorch-msssim's; no full-resolution maps at large images); a
    target in host memory (tile:stream) is then read a block of rows at a time."""
    out = out.float().clamp(0, 1)
    if target.device != out.device and not chunk_rows:
        target = target.to(out.device)
    target = target.float()
    mse = _mse(out, target, chunk_rows).clamp_min(1e-12)
    if chunk_rows:
        ssim_value, msssim_value = chunked_ssim_and_msssim(out, target, msssim_weights(scales),
                                                           WIN_SIZE, chunk_rows)
    else:
        ssim_value = ssim(out, target, data_range=1.0, win_size=WIN_SIZE)
        msssim_value = msssim(out, target, msssim_weights(scales))
    return {
        "loss": float(1 - msssim_value),
        "ssim": float(ssim_value),
        "psnr": float(torch.mean(10 * torch.log10(1.0 / mse))),
    }


def _mse(out: torch.Tensor, target: torch.Tensor, rows: int) -> torch.Tensor:
    """Mean squared error per image; a host target by blocks of `rows` rows."""
    if target.device == out.device:
        return torch.mean((out - target) ** 2, dim=(1, 2, 3))
    total = sum(((out[..., r:r + rows, :] - on_device(target[..., r:r + rows, :], out.device))
                 ** 2).sum(dim=(1, 2, 3)) for r in range(0, out.shape[-2], rows))
    return total / out[0].numel()


class SegmentFigures:
    """Validation figures of segmentation over a whole set, added batch by batch: the loss
    (mean per image, as for enhancement), Dice and IoU of the hard prediction from pixel
    counts summed over the set (segment_loss.dice_iou), in blocks of `rows` rows."""

    def __init__(self, classes: int, rows: int = LOSS_CHUNK_ROWS):
        self.classes, self.rows = classes, rows
        self.loss, self.images, self.counts = 0.0, 0, None

    def add(self, out: torch.Tensor, target: torch.Tensor) -> None:
        loss, counts = segment_scores(out, target, self.classes, self.rows)
        self.loss += loss * len(out)
        self.images += len(out)
        self.counts = counts if self.counts is None else self.counts + counts

    def result(self) -> dict[str, float]:
        dice, iou = dice_iou(self.counts)
        return {"loss": self.loss / self.images, "dice": dice, "iou": iou}
