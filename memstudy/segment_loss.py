"""The segmentation loss (Dice + BCE or Dice + cross-entropy) and its figures, in row blocks.

The loss of logits z (N, C, H, W) against a mask of class indices (N, 1, H, W):
- C = 1 (binary, a sigmoid per pixel): mean binary cross-entropy over the N*H*W pixels, plus
  1 - Dice of the foreground;
- C >= 2 (a softmax over the C channels): mean cross-entropy over the pixels, plus 1 - the mean
  over all C classes of each class's Dice.
Dice is soft, over the whole batch: (2 sum(p * t) + SMOOTH) / (sum(p) + sum(t) + SMOOTH) per
class, p the predicted probability, t the one-hot mask; SMOOTH keeps a class that is absent
from mask and prediction at Dice 1 rather than 0 / 0.

Why blocks: written plainly the loss makes the probabilities, the one-hot mask, the log
probabilities and their products as full-resolution float32 maps (C of each), and autograd
keeps several of them for backward; at 4188 x 4188 px one float32 map is 70 MB per channel,
alive exactly when the model's activations peak. The loss is a function of a few sums over
pixels only (the cross-entropy's, and per class sum(p * t), sum(p), sum(t)), so:
- forward runs `rows` rows of pixels at a time, without autograd, and adds each block's sums;
  it saves the logits (the model's output, alive anyway, in its own dtype) and the mask;
- backward first takes d loss / d sums from the small sums, then runs the blocks again, each
  with autograd on for the block alone: the gradient of the block's sums weighted by those
  derivatives is exactly the block of d loss / d logits (the loss is linear in each pixel's
  contribution to the sums), written into the logits' gradient in the logits' dtype.
Memory: nothing of full resolution but the logits' gradient, which the model needs anyway; the
temporaries are one block's (SEGMENT_ROW_MAPS float32 maps per row and channel, quality.py).
Cost: the element-wise work of forward runs twice (once in forward, once inside backward);
it is a handful of element-wise passes over C maps, small beside the network's convolutions.

The same block pass gives the validation figures (`segment_scores`): the loss's value, and the
pixel counts of the hard prediction (z > 0, or the arg-max class) that Dice and IoU are made of.
tests/test_segment.py checks value and gradient against the plain computation in float64.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from memstudy.streaming import on_device

SMOOTH = 1.0  # added to numerator and denominator of the soft Dice (pixels)


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for the blocks (bf16 / fp16 logits are widened one block at a time), float64
    kept (the exactness tests)."""
    return torch.promote_types(logits.dtype, torch.float32)


def check_shapes(logits: torch.Tensor, target: torch.Tensor, classes: int) -> None:
    """The network's output must be the mask's pixels (padding cropped) and `classes` channels."""
    n, c, h, w = logits.shape
    if c != classes:
        raise ValueError(f"the network gives {c} output channels but model.classes = {classes}; "
                         "they must be equal for train.task = 'segment'")
    if tuple(target.shape) != (n, 1, h, w):
        raise ValueError(f"the network's output is {n}x{c}x{h}x{w} (N x C x H x W) but its mask "
                         f"is {'x'.join(map(str, target.shape))}; the output must be cropped to "
                         "the mask's pixels, with one mask channel of class indices")


def block_terms(z: torch.Tensor, mask: torch.Tensor, classes: int):
    """One block's sums: (cross-entropy sum, per class sum(p * t), sum(p), sum(t)).
    `z` is the block's logits in the compute dtype, `mask` its class indices (N, 1, h, W)."""
    dims = (0, 2, 3)
    if classes == 1:
        t = mask.to(z.dtype)
        ce = F.binary_cross_entropy_with_logits(z, t, reduction="sum")
        p = torch.sigmoid(z)
    else:
        index = mask[:, 0].long()
        ce = F.cross_entropy(z, index, reduction="sum")
        p = torch.softmax(z, dim=1)
        t = torch.zeros_like(z).scatter_(1, index[:, None], 1.0)  # one-hot, this block only
    return ce, (p * t).sum(dims), p.sum(dims), t.sum(dims)


def combine(ce, inter, pred, truth, pixels: int) -> torch.Tensor:
    """The loss from its sums: mean cross-entropy + 1 - mean soft Dice over the classes."""
    dice = (2 * inter + SMOOTH) / (pred + truth + SMOOTH)
    return ce / pixels + 1 - dice.mean()


def row_blocks(height: int, rows: int):
    for start in range(0, height, rows):
        yield start, min(start + rows, height)


def _block(t: torch.Tensor, r0: int, r1: int, device: torch.device | None = None) -> torch.Tensor:
    """Rows r0:r1 of `t`, on `device` (a host target, tile:stream, copied in a block at a time)."""
    return on_device(t[..., r0:r1, :], device)


def loss_sums(logits, target, classes: int, rows: int) -> list[torch.Tensor]:
    """The loss's sums over every block (no autograd)."""
    dtype, total = compute_dtype(logits), None
    with torch.no_grad():
        for r0, r1 in row_blocks(logits.shape[-2], rows):
            terms = block_terms(_block(logits, r0, r1).to(dtype),
                                _block(target, r0, r1, logits.device), classes)
            total = list(terms) if total is None else [a + b for a, b in zip(total, terms)]
    return total


class ChunkedSegmentLoss(torch.autograd.Function):
    """`combine` of the block sums; backward block by block (see the module docstring)."""

    @staticmethod
    def forward(ctx, logits, target, classes: int, rows: int):
        sums = loss_sums(logits, target, classes, rows)
        pixels = logits.shape[0] * logits.shape[2] * logits.shape[3]
        # through save_for_backward, so that memstudy's saved-tensor meters count them
        ctx.save_for_backward(logits, target, *sums)
        ctx.classes, ctx.rows, ctx.pixels = classes, rows, pixels
        return combine(*sums, pixels)

    @staticmethod
    def backward(ctx, grad_value):
        logits, target, *sums = ctx.saved_tensors
        weights = _sum_weights(sums, ctx.pixels, grad_value)
        grad = torch.empty_like(logits)
        dtype = compute_dtype(logits)
        for r0, r1 in row_blocks(logits.shape[-2], ctx.rows):
            z = _block(logits, r0, r1).detach().to(dtype).requires_grad_(True)
            with torch.enable_grad():
                ce, inter, pred, _ = block_terms(z, _block(target, r0, r1, logits.device),
                                                 ctx.classes)
                linear = weights[0] * ce + (weights[1] * inter).sum() + (weights[2] * pred).sum()
                (block,) = torch.autograd.grad(linear, z)
            _block(grad, r0, r1).copy_(block)
        return grad, None, None, None


def _sum_weights(sums, pixels: int, grad_value):
    """d loss / d (ce, inter, pred), from the small sums (sum(t) holds no logits)."""
    leaves = [s.detach().requires_grad_(True) for s in sums[:3]]
    with torch.enable_grad():
        return torch.autograd.grad(combine(*leaves, sums[3], pixels), leaves, grad_value)


def segment_loss(logits: torch.Tensor, target: torch.Tensor, classes: int,
                 rows: int = 0) -> torch.Tensor:
    """The loss; rows > 0 in blocks of that many rows, 0 in one piece with plain autograd."""
    check_shapes(logits, target, classes)
    if rows:
        return ChunkedSegmentLoss.apply(logits, target, classes, rows)
    sums = block_terms(logits.to(compute_dtype(logits)), target, classes)
    return combine(*sums, logits.shape[0] * logits.shape[2] * logits.shape[3])


def scored_classes(classes: int) -> range:
    """The classes Dice and IoU average over: the foreground (binary), or every class but the
    background, index 0 (several classes)."""
    return range(1) if classes == 1 else range(1, classes)


def hard_counts(z: torch.Tensor, mask: torch.Tensor, classes: int) -> torch.Tensor:
    """(3, K) int64 pixel counts of the hard prediction per scored class: intersection,
    predicted, true. Binary: z > 0 (probability > 0.5); several classes: the arg-max."""
    if classes == 1:
        pred, truth, ids = (z > 0)[:, 0], mask[:, 0] != 0, [None]
    else:
        pred, truth, ids = z.argmax(dim=1), mask[:, 0].long(), list(scored_classes(classes))
    rows = []
    for c in ids:
        p, t = (pred, truth) if c is None else (pred == c, truth == c)
        rows.append(torch.stack([(p & t).sum(), p.sum(), t.sum()]))
    return torch.stack(rows, dim=1)


@torch.no_grad()
def segment_scores(logits, target, classes: int, rows: int) -> tuple[float, torch.Tensor]:
    """(the loss's value, hard_counts summed over the blocks) in one block pass."""
    check_shapes(logits, target, classes)
    dtype, sums, counts = compute_dtype(logits), None, None
    for r0, r1 in row_blocks(logits.shape[-2], rows):
        z, mask = _block(logits, r0, r1).to(dtype), _block(target, r0, r1, logits.device)
        terms = block_terms(z, mask, classes)
        sums = list(terms) if sums is None else [a + b for a, b in zip(sums, terms)]
        here = hard_counts(z, mask, classes)
        counts = here if counts is None else counts + here
    pixels = logits.shape[0] * logits.shape[2] * logits.shape[3]
    return float(combine(*sums, pixels)), counts


def dice_iou(counts: torch.Tensor) -> tuple[float, float]:
    """Dice 2I / (P + T) and IoU I / (P + T - I) of each scored class, from the counts summed
    over the whole validation set, averaged over the classes present in the mask or the
    prediction; 1.0 when no class is (nothing to find, nothing found)."""
    inter, pred, truth = (row.tolist() for row in counts.cpu())
    present = [(i, p + t) for i, p, t in zip(inter, pred, truth) if p + t > 0]
    if not present:
        return 1.0, 1.0
    dice = sum(2 * i / s for i, s in present) / len(present)
    iou = sum(i / (s - i) for i, s in present) / len(present)
    return dice, iou
