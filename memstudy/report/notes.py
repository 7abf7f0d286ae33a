"""The lines a report prints under a table: why it is empty, or why its quality column cannot
rank the sets.

Quality (validation loss, SSIM, PSNR, a loss difference against original) ranks technique sets
only from runs long enough and repeated often enough (docs/metrics.md, "Ranking quality"):
- QUALITY_MIN_EPOCHS: in the study's protocol on an H100 (docs/paper.md: 512 px, 48 images,
  50 epochs, four seeds), the mean validation loss after epoch 1 is 32 times its 50-epoch
  value and 3.7 times after epoch 5, and the seeds' relative spread is 16-18% over epochs 1-5;
  from epoch 10 the loss is within 2.3 times its final value and the spread settles at 6-8%.
- QUALITY_MIN_SEEDS: a difference is read against the seed spread (mean +- std, as
  docs/paper.md compares sets); one seed has no spread, two give a std of one degree of freedom.
A table whose quality comes from fewer says so in one line; its losses then show that the sets
train, not which trains better.
"""
from __future__ import annotations

from typing import Any

QUALITY_MIN_EPOCHS = 10
QUALITY_MIN_SEEDS = 3
# per table: (the quality column, its epochs, its seeds) in the rows
QUALITY_FIELDS = {"losses": ("val_loss", "epochs", "runs"),
                  "pareto": ("val_loss", "epochs", "quality_seeds"),
                  "decisions": ("val_loss_delta", "quality_epochs", "quality_seeds")}
EMPTY = {"largest_size": "no maxres search in this database (memstudy maxres --budget 8GiB "
                         "--sets original --sets amp:bf16,checkpoint searches it per set)"}


def quality_warning(rows: list[dict[str, Any]], value: str, epochs: str, seeds: str) -> str:
    """One line where some row's quality comes from fewer epochs or seeds than rank it."""
    shown = [r for r in rows if r.get(value) is not None]
    fewest_epochs = min((r[epochs] for r in shown if r.get(epochs) is not None), default=None)
    fewest_seeds = min((r[seeds] for r in shown if r.get(seeds) is not None), default=None)
    short = fewest_epochs is not None and fewest_epochs < QUALITY_MIN_EPOCHS
    few = fewest_seeds is not None and fewest_seeds < QUALITY_MIN_SEEDS
    if not (short or few):
        return ""
    return (f"warning: quality here comes from as few as {fewest_epochs} epoch(s) and "
            f"{fewest_seeds} seed(s), fewer than the {QUALITY_MIN_EPOCHS} epochs and "
            f"{QUALITY_MIN_SEEDS} seeds that can rank sets (docs/metrics.md, \"Ranking quality\"): "
            "it shows that the sets train, not which trains better")


def table_note(name: str, rows: list[dict[str, Any]], empty: dict[str, str]) -> str:
    """The line under table `name`: why it is empty (`empty` given by the caller, else EMPTY,
    else '(no runs)'), or its quality warning, or ''."""
    if not rows:
        return empty.get(name) or EMPTY.get(name, "(no runs)")
    if name in QUALITY_FIELDS:
        return quality_warning(rows, *QUALITY_FIELDS[name])
    return ""
