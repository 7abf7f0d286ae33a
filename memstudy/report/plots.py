"""The study's figures as matplotlib Figures (no pyplot state: safe in scripts and notebooks).

`png(fig)` gives the bytes the HTML report embeds; in a notebook, show them with
IPython.display.Image(png(fig)).
"""
from __future__ import annotations

import io
from collections import defaultdict
from typing import Any

from memstudy.report.data import TRAIN_PHASES

Rows = list[dict[str, Any]]


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def ratio_chart(rows: Rows):
    """Fig. 2: bars of each technique set's memory / original's, per phase, one panel per size."""
    sizes = sorted({r["image_size"] for r in rows})
    fig = _figure(4.5 * max(len(sizes), 1), 3.6)
    axes = fig.subplots(1, max(len(sizes), 1), squeeze=False)[0]
    for ax, size in zip(axes, sizes or [None]):
        here = [r for r in rows if r["image_size"] == size]
        width = 0.8 / max(len(here), 1)
        for i, r in enumerate(here):
            xs = [p + (i - (len(here) - 1) / 2) * width for p in range(len(TRAIN_PHASES))]
            ax.bar(xs, [r[p] or 0 for p in TRAIN_PHASES], width, label=f"{r['name']} ({r['device']})")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(TRAIN_PHASES)), [p.capitalize() for p in TRAIN_PHASES])
        ax.set_ylabel("memory / original")
        ax.set_title(f"{size} px" if size else "no runs with an original baseline")
        if here:
            ax.legend(fontsize=7)
    return fig


def resolution_chart(rows: Rows, budget_mb: float | None = None):
    """Peak memory vs image size per technique set; runs that failed are marked x at the
    size where they stopped; the budget is a horizontal line."""
    fig = _figure(6.4, 4.2)
    ax = fig.subplots()
    lines: dict[tuple[str, str], list] = defaultdict(list)
    for r in rows:
        lines[(r["name"], r["device"])].append(r)
    top = max([r["peak_mb"] or 0 for r in rows] + [budget_mb or 0]) or 1
    for (name, device), runs in sorted(lines.items()):
        ok = sorted({r["image_size"]: r for r in runs if r["status"] == "ok" and r["peak_mb"]}.values(),
                    key=lambda r: r["image_size"])
        line = ax.plot([r["image_size"] for r in ok], [r["peak_mb"] for r in ok], marker="o",
                       label=f"{name} ({device})")[0]
        failed = sorted({r["image_size"] for r in runs if r["status"] == "oom"})
        ax.plot(failed, [top * 1.05] * len(failed), linestyle="none", marker="x",
                color=line.get_color())
    if budget_mb:
        ax.axhline(budget_mb, color="red", linestyle="--", label=f"budget {budget_mb:.0f} MB")
    ax.set_xlabel("image size (px, square)")
    ax.set_ylabel("peak memory (MB)")
    ax.set_title("Memory vs resolution (x: out of memory)")
    if lines:
        ax.legend(fontsize=7)
    return fig


def largest_size_chart(rows: Rows):
    """Predicted and found largest trainable size per technique set."""
    fig = _figure(6.4, 0.5 * max(len(rows), 2) + 1.2)
    ax = fig.subplots()
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], [r["predicted_px"] or 0 for r in rows], 0.4, label="predicted")
    ax.barh([y - 0.2 for y in ys], [r["found_px"] or 0 for r in rows], 0.4, label="found")
    ax.set_yticks(list(ys), [f"{r['name']} ({r['budget']})" for r in rows])
    ax.set_xlabel("largest square size (px)")
    if rows:
        ax.legend(fontsize=7)
    return fig


def loss_curve_chart(rows: Rows):
    """Training loss (1 - MS-SSIM) per step, one line per run."""
    fig = _figure(6.4, 4.0)
    ax = fig.subplots()
    runs: dict[int, list] = defaultdict(list)
    for r in rows:
        runs[r["run_id"]].append(r)
    for run_id, points in sorted(runs.items()):
        ax.plot([p["step"] for p in points], [p["loss"] for p in points],
                label=f"{points[0]['name']} {points[0]['image_size']} px (run {run_id})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (1 - MS-SSIM)")
    if runs:
        ax.legend(fontsize=7)
    return fig
