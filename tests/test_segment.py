"""Segmentation (train.task = "segment"): the chunked Dice + BCE / cross-entropy loss against
the plain computation, its memory, and the validation figures Dice and IoU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memstudy.quality import SEGMENT_ROW_MAPS, SegmentFigures, SegmentLoss
from memstudy.segment_loss import SMOOTH, dice_iou, segment_loss, segment_scores

TOLERANCE = 1e-12  # float64: value and gradient agree to rounding (sums in another order)


def _logits_and_mask(shape, classes, seed=0, dtype=torch.float64):
    n, h, w = shape
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(n, classes, h, w, generator=g, dtype=dtype)).requires_grad_(True)
    mask = torch.randint(0, max(classes, 2), (n, 1, h, w), generator=g, dtype=torch.uint8)
    return logits, mask


def _plain(logits, mask, classes):
    """The loss written plainly with PyTorch's own functions, on whole images."""
    if classes == 1:
        t = mask.to(logits.dtype)
        ce, p = F.binary_cross_entropy_with_logits(logits, t), torch.sigmoid(logits)
    else:
        index = mask[:, 0].long()
        ce, p = F.cross_entropy(logits, index), torch.softmax(logits, 1)
        t = F.one_hot(index, classes).permute(0, 3, 1, 2).to(logits.dtype)
    dims = (0, 2, 3)
    dice = (2 * (p * t).sum(dims) + SMOOTH) / (p.sum(dims) + t.sum(dims) + SMOOTH)
    return ce + 1 - dice.mean()


@pytest.mark.parametrize("shape, classes, rows", [
    ((2, 37, 29), 1, 5),     # binary, batch 2, blocks that do not divide the rows
    ((1, 40, 24), 3, 7),     # three classes
    ((2, 33, 20), 4, 64),    # one block larger than the image
    ((1, 19, 17), 2, 1),     # two classes by cross-entropy, one row per block
])
def test_chunked_loss_equals_the_plain_loss_in_value_and_gradient(shape, classes, rows):
    logits, mask = _logits_and_mask(shape, classes)
    want = _plain(logits, mask, classes)
    (want_grad,) = torch.autograd.grad(want, logits)
    for chunk in (rows, 0):  # chunked, and the unchunked path (train.loss_chunk_rows = 0)
        got = segment_loss(logits, mask, classes, chunk)
        (grad,) = torch.autograd.grad(got, logits)
        assert abs(float(got.detach() - want.detach())) <= TOLERANCE * abs(float(want.detach()))
        assert float((grad - want_grad).abs().max()) <= TOLERANCE * float(want_grad.abs().max())


def test_loss_module_widens_low_precision_logits_one_block_at_a_time():
    """bf16 logits (autocast): computed in float32 per block, the gradient in bf16; equal to the
    plain loss of the widened logits to float32 rounding."""
    logits, mask = _logits_and_mask((1, 48, 40), 3, seed=2, dtype=torch.bfloat16)
    got = SegmentLoss(3, chunk_rows=16)(logits, mask)
    (grad,) = torch.autograd.grad(got, logits)
    wide = logits.detach().float().requires_grad_(True)
    want = _plain(wide, mask, 3)
    (want_grad,) = torch.autograd.grad(want, wide)
    assert grad.dtype == torch.bfloat16 and got.dtype == torch.float32
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    # bf16 keeps 8 bits: the gradients differ by its rounding of float32 sums in another order
    assert float((grad.float() - want_grad).abs().max()) <= 1e-2 * float(want_grad.abs().max())


def test_loss_refuses_an_uncropped_output_or_wrong_channels():
    logits, mask = _logits_and_mask((1, 32, 32), 2)
    with pytest.raises(ValueError, match="cropped to the mask's pixels"):
        segment_loss(logits, mask[..., :30, :], 2, 8)
    with pytest.raises(ValueError, match="model.classes = 3"):
        segment_loss(logits, mask, 3, 8)


def _peak_bytes(rows: int, classes=3, shape=(1, 512, 256)) -> int:
    """Peak live bytes of the loss's forward + backward (tensor meter), inputs excluded."""
    from memstudy.meters.tensor import LiveTensorMeter

    logits, mask = _logits_and_mask(shape, classes, dtype=torch.float32)
    with LiveTensorMeter() as meter:
        segment_loss(logits, mask, classes, rows).backward()
    return meter.peak


def test_segment_row_maps_bounds_the_loss_memory_per_block_row():
    """auto_chunk_rows sizes the segmentation loss's blocks with SEGMENT_ROW_MAPS float32 maps
    per block row and channel: the peak grows by at most that per added row (the slope between
    two block heights), and the bound is not loose by more than 4x."""
    classes, width = 3, 256
    slope = (_peak_bytes(256) - _peak_bytes(64)) / (256 - 64)
    row_bytes = 4 * classes * width
    assert slope <= SEGMENT_ROW_MAPS * row_bytes, slope / row_bytes
    assert slope >= SEGMENT_ROW_MAPS * row_bytes / 4, slope / row_bytes


def test_chunked_loss_keeps_no_full_resolution_maps():
    """Unchunked, the loss's peak holds several float32 maps per class; in blocks of 32 of 512
    rows it holds the gradient of the logits (which the model needs) and one block's maps."""
    classes, h, w = 3, 512, 256
    map_bytes = 4 * classes * h * w  # one float32 map of every class
    plain, chunked = _peak_bytes(0), _peak_bytes(32)
    assert plain > 3 * map_bytes  # measured: 4.7 maps per class
    assert chunked <= map_bytes + SEGMENT_ROW_MAPS * 32 * 4 * classes * w


def test_validation_figures_count_the_hard_prediction():
    """Dice and IoU from pixel counts summed over every batch, per class, background left
    out, against counts taken directly (two batches, blocks that do not divide the rows); the
    loss the mean of the batches' plain losses."""
    classes, figures = 3, SegmentFigures(3, rows=7)
    counts = torch.zeros(3, 2, dtype=torch.long)  # intersection, predicted, true x classes 1, 2
    losses = []
    for seed in (0, 1):
        logits, mask = _logits_and_mask((2, 30, 21), classes, seed=seed)
        figures.add(logits.detach(), mask)
        losses.append(float(_plain(logits, mask, classes).detach()))
        hard, index = logits.argmax(1), mask[:, 0].long()
        for k, c in enumerate((1, 2)):
            p, t = hard == c, index == c
            counts[:, k] += torch.stack([(p & t).sum(), p.sum(), t.sum()])
    inter, pred, truth = counts.double()
    got = figures.result()
    assert got["loss"] == pytest.approx(sum(losses) / 2, rel=1e-12)
    assert got["dice"] == pytest.approx(float((2 * inter / (pred + truth)).mean()), rel=1e-12)
    assert got["iou"] == pytest.approx(float((inter / (pred + truth - inter)).mean()), rel=1e-12)


def test_dice_and_iou_from_counts():
    # class 1: 3 of 4 predicted pixels right, 5 true; class 2 absent from both: left out
    counts = torch.tensor([[3, 0], [4, 0], [5, 0]])
    dice, iou = dice_iou(counts)
    assert dice == pytest.approx(2 * 3 / 9) and iou == pytest.approx(3 / 6)
    assert dice_iou(torch.zeros(3, 2, dtype=torch.long)) == (1.0, 1.0)


def test_binary_scores_threshold_the_logits_at_zero():
    logits = torch.tensor([[[[2.0, -1.0], [0.5, -3.0]]]])
    mask = torch.tensor([[[[1, 1], [0, 0]]]], dtype=torch.uint8)
    _, counts = segment_scores(logits, mask, 1, rows=1)
    assert counts.tolist() == [[1], [2], [2]]  # intersection, predicted, true


def test_task_is_checked_by_name_and_part_of_the_hash():
    """"segment" is another run than "enhance"; anything else is refused in one line. (That the
    default leaves every recorded hash as it was is pinned by tests/test_records.py: it fails
    when train.task is taken out of HASH_NEUTRAL_DEFAULTS.)"""
    from memstudy.config import RunConfig, set_value
    from memstudy.errors import ConfigError

    cfg = RunConfig()
    before = cfg.hash()
    set_value(cfg, "train.task=enhance")
    assert cfg.hash() == before
    set_value(cfg, "train.task=segment")
    assert cfg.hash() != before
    cfg.train.task = "segmentation"
    with pytest.raises(ConfigError, match=r"^train.task 'segmentation' unknown; choose one of "
                                          r"\('enhance', 'segment'\)$"):
        cfg.train.check()
