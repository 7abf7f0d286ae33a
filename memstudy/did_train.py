"""Did a run train? The flag `runs.trained` and the one rule that sets it.

The rule: a run did **not** train when it recorded at least two training steps and, on every
rank, every step's training loss is bit-identical to that rank's first (docs/metrics.md, "Runs
that did not train"). It trained when some rank's loss changed; with fewer than two steps on
every rank it is not judged (None).

Why this rule. The loss is read back once per step already (`train._train_step`'s `.item()`,
after the optimizer step), so judging it adds no host sync and no kernel to a measured step;
a gradient test (every parameter's gradient zero) would add a reduction over every gradient
to each step, and techniques that shard, offload or compress gradients hold them in forms
such a test would have to know. The rule cannot misfire on a run that trains slowly: steps
see different images (a new order every epoch) or, with one image, weights that moved, so a
trained loss changes at least in its last bits from one step to the next. A loss pinned to
one float at every step means the loss sits on a clamp: MS-SSIM as pytorch-msssim computes
it multiplies its per-scale terms after a relu, so when one scale's term is negative the
product, and with it the loss 1 - MS-SSIM, is exactly 1 for every batch, and the relu's
backward hands every parameter a gradient of exactly 0 (a dead start: docs/paper.md, seed 1).
Weight decay still shrinks such weights, but no gradient ever reaches them.

What it does not catch: a model that does not move while its loss varies from batch to batch
(a learning rate of 0 over several images); that is a miss, never a false flag. Runs recorded
before the flag existed (column NULL) are judged by the same rule from their stored loss
series when read (memstudy.report.data.load_runs). Torch-free.
"""
from __future__ import annotations

from typing import Iterable

# per rank: (steps, smallest loss, largest loss); smallest == largest <=> every loss equal
LossRange = tuple[int, float, float]


def loss_ranges(series: Iterable[tuple[int, int, str, float]]) -> dict[int, LossRange]:
    """Per rank, the (steps, min, max) of the `loss` rows of a run's series
    (rank, step, name, value), as SQL's COUNT / MIN / MAX would give them."""
    out: dict[int, LossRange] = {}
    for rank, _step, name, value in series:
        if name != "loss":
            continue
        n, lo, hi = out.get(rank, (0, value, value))
        out[rank] = (n + 1, min(lo, value), max(hi, value))
    return out


def judge(ranges: Iterable[LossRange]) -> bool | None:
    """True: some rank's loss changed; False: every judged rank's loss was bit-identical at
    every step (the run did not train); None: no rank recorded two steps."""
    judged = [(lo, hi) for steps, lo, hi in ranges if steps >= 2]
    if not judged:
        return None
    return any(lo != hi for lo, hi in judged)


def describe(trained: bool | None, ranges: dict[int, LossRange] | None = None) -> str:
    """A few words for a run's outcome line: '' unless the run did not train."""
    if trained is not False:
        return ""
    if not ranges:
        return "did not train"
    steps, value, _hi = max(ranges.values())
    return f"did not train (training loss {value:g} at every one of {steps} steps)"
