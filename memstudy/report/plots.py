"""The study's figures as matplotlib Figures (no pyplot state: safe in scripts and notebooks).

`png(fig)` gives the bytes the HTML report embeds; in a notebook, show them with
IPython.display.Image(png(fig)).
"""
from __future__ import annotations

import io
import math
from collections import defaultdict
from typing import Any

from memstudy.report.data import TRAIN_PHASES
from memstudy.image_sizes import NATIVE, size_hw, size_sort_key

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
    from matplotlib import colormaps

    sizes = sorted({r["image_size"] for r in rows}, key=size_sort_key)
    labels = sorted({f"{r['name']} ({r['device']})" for r in rows})
    colors = colormaps["tab20"].resampled(max(len(labels), 1))  # one distinct colour per set
    color = {label: colors(i) for i, label in enumerate(labels)}
    fig = _figure(4.5 * max(len(sizes), 1), 3.6 + 0.18 * len(labels))
    axes = fig.subplots(1, max(len(sizes), 1), squeeze=False)[0]
    for ax, size in zip(axes, sizes or [None]):
        here = [r for r in rows if r["image_size"] == size]
        width = 0.8 / max(len(here), 1)
        for i, r in enumerate(here):
            label = f"{r['name']} ({r['device']})"
            xs = [p + (i - (len(here) - 1) / 2) * width for p in range(len(TRAIN_PHASES))]
            ax.bar(xs, [r[p] or 0 for p in TRAIN_PHASES], width, label=label, color=color[label])
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(TRAIN_PHASES)), [p.capitalize() for p in TRAIN_PHASES])
        ax.set_ylabel("memory / original")
        ax.set_title(_size_title(size) if size is not None else "no runs with an original baseline")
    if labels:  # one legend for all panels, under them, so it hides no bar
        handles = {h.get_label(): h for ax in axes for h in ax.containers}
        fig.legend([handles[k] for k in labels if k in handles], [k for k in labels if k in handles],
                   loc="outside lower center", ncols=min(3, len(labels)), fontsize=7)
    return fig


def _size_title(size) -> str:
    return "native sizes" if size == NATIVE else f"{size} px"


def axis_px(size) -> float | None:
    """Where a stored size sits on a numeric px axis: a square at its side, a rectangle HxW
    at sqrt(H x W) (the square of equal pixel count, so the axis keeps size_sort_key's
    order); None for 'native' (each image its own size: no place on the axis)."""
    hw = size_hw(size)
    return None if hw is None else math.sqrt(hw[0] * hw[1])


def resolution_chart(rows: Rows, budget_mb: float | None = None):
    """Peak memory vs image size per technique set; runs that failed are marked x at the
    size where they stopped; the budget is a horizontal line. Rectangles sit at the side of
    the square with their pixel count, labelled HxW; native-size runs are left off the axis
    and counted in the title."""
    fig = _figure(6.4, 4.2)
    ax = fig.subplots()
    lines: dict[tuple[str, str], list] = defaultdict(list)
    placed = [r for r in rows if axis_px(r["image_size"]) is not None]
    for r in placed:
        lines[(r["name"] + (f" [{r['differs']}]" if r.get("differs") else ""), r["device"])].append(r)
    top = max([r["peak_mb"] or 0 for r in placed] + [budget_mb or 0]) or 1
    for (name, device), runs in sorted(lines.items()):
        ok = sorted({r["image_size"]: r for r in runs if r["status"] == "ok" and r["peak_mb"]}.values(),
                    key=lambda r: size_sort_key(r["image_size"]))
        line = ax.plot([axis_px(r["image_size"]) for r in ok], [r["peak_mb"] for r in ok],
                       marker="o", label=f"{name} ({device})")[0]
        failed = sorted({r["image_size"] for r in runs if r["status"] == "oom"}, key=size_sort_key)
        ax.plot([axis_px(s) for s in failed], [top * 1.05] * len(failed), linestyle="none",
                marker="x", color=line.get_color())
        for size, y in [(r["image_size"], r["peak_mb"]) for r in ok] + [(s, top * 1.05) for s in failed]:
            if isinstance(size, str):  # a rectangle: say which, its x is only its pixel count
                ax.annotate(size, (axis_px(size), y), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
    if budget_mb:
        ax.axhline(budget_mb, color="red", linestyle="--", label=f"budget {budget_mb:.0f} MB")
    ax.set_xlabel("image size (px; a rectangle HxW at sqrt(H x W))")
    ax.set_ylabel("peak memory (MB)")
    native = len(rows) - len(placed)
    ax.set_title("Memory vs resolution (x: out of memory)" + (
        f"\n{native} native-size run(s) not plotted: no single size" if native else ""))
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


def tri_control_chart(series: dict[str, Any], title: str = ""):
    """One Tri-Accel run over its control steps (memstudy.report.triaccel_section.control_series):
    per-unit precision as a heat map, lambda_max and learning rate per unit, batch size,
    memory used vs capacity. Panels with no rows (a part switched off) say so."""
    from matplotlib.colors import ListedColormap

    fig = _figure(12, 10)
    fig.suptitle(title, fontsize=9)
    (heat, lam), (lr, batch), (mem, legend) = fig.subplots(3, 2)
    units, levels = series["units"], series["levels"]
    steps = sorted({s for pts in series["precision"].values() for s, _ in pts})
    if steps:
        col = {s: i for i, s in enumerate(steps)}
        grid = [[float("nan")] * len(steps) for _ in units]
        for u, unit in enumerate(units):
            for s, v in series["precision"].get(unit, []):
                grid[u][col[s]] = v
        # one column per control step, centred on its step number (t_ctrl apart), so the
        # x axis matches the other panels
        half = (steps[1] - steps[0]) / 2 if len(steps) > 1 else 0.5
        image = heat.imshow(grid, aspect="auto", interpolation="nearest", vmin=-0.5,
                            vmax=len(levels) - 0.5,
                            extent=(steps[0] - half, steps[-1] + half, len(units) - 0.5, -0.5),
                            cmap=ListedColormap(["#4c72b0", "#55a868", "#c44e52"][:len(levels)]))
        heat.set_yticks(range(len(units)), units, fontsize=7)
        fig.colorbar(image, ax=heat, ticks=range(len(levels))).ax.set_yticklabels(levels)
    _panel(heat, "precision per unit", "control step", bool(steps))
    for ax, kind, label in ((lam, "lambda_max", "lambda_max (symlog)"), (lr, "lr", "learning rate")):
        for i, unit in enumerate(units):  # 11 units, 10 colours: dashed after the tenth
            pts = series[kind].get(unit, [])
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker=".", label=unit,
                    color=f"C{i % 10}", linestyle="-" if i < 10 else "--")
        _panel(ax, label, "step", any(series[kind].values()))
    lam.set_yscale("symlog", linthresh=1e-6)  # eigenvalues span 1e-6..1 and may be negative
    pts = series["batch_size"]
    batch.step([s for s, _ in pts], [v for _, v in pts], where="post", label="batch (every step)")
    pts = series["batch_next"]
    batch.plot([s for s, _ in pts], [v for _, v in pts], "o", label="chosen at control step")
    _panel(batch, "batch size", "step", bool(series["batch_size"]))
    for key in ("mem_used_mb", "mem_capacity_mb"):
        pts = series[key]
        mem.plot([s for s, _ in pts], [v for _, v in pts], marker=".", label=key[4:-3])
    _panel(mem, "memory (MB): window peak used vs capacity", "control step",
           bool(series["mem_used_mb"]))
    legend.axis("off")
    handles, labels = max(lr.get_legend_handles_labels(), lam.get_legend_handles_labels(),
                          key=lambda hl: len(hl[0]))
    if handles:
        legend.legend(handles, labels, loc="center", fontsize=8, title="unit")
    return fig


def _panel(ax, title: str, xlabel: str, has_data: bool) -> None:
    ax.set_title(title if has_data else f"{title}: not recorded (part off)", fontsize=9)
    ax.set_xlabel(xlabel)
    if has_data and ax.get_legend_handles_labels()[0] and len(ax.lines) <= 3:
        ax.legend(fontsize=7)
