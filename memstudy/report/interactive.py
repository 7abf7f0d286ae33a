"""The HTML report's interactive figures, built with Plotly from the report's rows.

Plotly draws in the browser: every point carries its values for hover, and clicking a legend
entry hides or shows that series, so a reader can compare two sets at one size without a
second plot. The price is the library itself (about 4.6 MB of JavaScript) inlined once into
the file so that it opens offline (memstudy.report.html); the figures themselves are only
their data. Each function returns a `plotly.graph_objects.Figure`, or None when its rows
hold nothing to draw.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import plotly.graph_objects as go

from memstudy.report.decide import CATEGORIES
from memstudy.report.data import TRAIN_PHASES
from memstudy.image_sizes import size_hw, size_label, size_sort_key

Rows = list[dict[str, Any]]
TEMPLATE = "plotly_white"


def _layout(fig: go.Figure, title: str, x: str, y: str, **extra: Any) -> go.Figure:
    fig.update_layout(template=TEMPLATE, title=title, xaxis_title=x, yaxis_title=y,
                      legend_title_text="click to hide / show", **({"height": 480} | extra))
    return fig


def pareto_chart(rows: Rows, device: str) -> go.Figure | None:
    """Peak MB against step time, one series per size (toggle sizes in the legend), the
    Pareto front of each size drawn as a line; hover names the set, its loss and seeds."""
    rows = [r for r in rows if r["device"] == device]
    if not rows:
        return None
    fig = go.Figure()
    by_size: dict[Any, Rows] = defaultdict(list)
    for r in rows:
        by_size[r["image_size"]].append(r)
    for size in sorted(by_size, key=size_sort_key):
        group = by_size[size]
        front = sorted((r for r in group if r["pareto"]), key=lambda r: r["peak_mb"])
        label = f"{size_label(size)} px"
        fig.add_trace(go.Scatter(  # each point named: the set (and what sets its row apart)
            x=[r["peak_mb"] for r in group], y=[r["step_time_s"] for r in group],
            mode="markers+text", name=label, legendgroup=label, textposition="top center",
            text=[r["name"] + (f" [{r['differs']}]" if r.get("differs") else "") for r in group],
            textfont={"size": 9},
            customdata=[[r["name"], _num(r["val_loss"], 4), r["runs"], r["label"],
                         "Pareto" if r["pareto"] else ""] for r in group],
            hovertemplate=(f"{label}<br>%{{customdata[0]}}<br>peak %{{x:.0f}} MB<br>step "
                           "%{y:.3f} s<br>val loss %{customdata[1]}<br>n %{customdata[2]} "
                           "(%{customdata[3]}) %{customdata[4]}<extra></extra>")))
        if len(front) > 1:
            fig.add_trace(go.Scatter(x=[r["peak_mb"] for r in front],
                                     y=[r["step_time_s"] for r in front], mode="lines",
                                     name=f"{label} Pareto front", legendgroup=label,
                                     showlegend=False, hoverinfo="skip", line={"dash": "dot"}))
    return _layout(fig, f"Peak memory against step time, {device}", "absolute peak (MB)",
                   "step time (s)", xaxis_type="log", yaxis_type="log")


def savings_chart(rows: Rows) -> go.Figure | None:
    """Memory held for backward at the forward's end per set, a bar series per size and device
    (memstudy.report.savings): what the runs answer where absolute peaks are model state."""
    rows = [r for r in rows if r["saved_mb"] is not None]
    if not rows:
        return None
    series: dict[tuple, Rows] = defaultdict(list)
    for r in rows:
        series[(size_label(r["image_size"]), r["device"])].append(r)
    fig = go.Figure([go.Bar(x=[r["name"] + (f" [{r['differs']}]" if r["differs"] else "")
                               for r in group], y=[r["saved_mb"] for r in group],
                            name=f"{size} px ({device})",
                            hovertemplate="%{x}: %{y:.1f} MB<extra></extra>")
                     for (size, device), group in series.items()])
    return _layout(fig, "Held for backward at the forward's end, per set", "techniques", "MB",
                   barmode="group")


def category_chart(rows: Rows, device: str, size: Any) -> go.Figure | None:
    """Stacked bars of what each phase holds at its end, by category, per set and phase,
    with the phase's absolute peak as a marker above (the gap is the phase's temporaries)."""
    rows = [r for r in rows if r["device"] == device and r["image_size"] == size]
    if not rows:
        return None
    x = [[f"{r['name']} ({r['label']})" for r in rows], [r["phase"] for r in rows]]
    fig = go.Figure()
    for key, label in CATEGORIES:
        fig.add_trace(go.Bar(x=x, y=[r[key] for r in rows], name=label,
                             hovertemplate=f"{label}: %{{y:.1f}} MB<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=[r["peak_abs_mb"] for r in rows], mode="markers",
                             name="absolute peak of the phase", marker={"symbol": "line-ew-open",
                                                                        "size": 18},
                             hovertemplate="peak %{y:.1f} MB<extra></extra>"))
    return _layout(fig, f"Memory by category at each phase's end, {size_label(size)} px, {device}",
                   "techniques / phase", "MB", barmode="stack", height=560)


def resolution_chart(rows: Rows, budget_mb: float | None) -> go.Figure | None:
    """Absolute peak MB against the side of the square with the same pixels, one line per
    set and device (failed runs marked x at the size where they stopped); the budget dashed."""
    series: dict[tuple, Rows] = defaultdict(list)
    for r in rows:
        if size_hw(r["image_size"]) is not None:
            series[(r["name"] + (f" [{r['differs']}]" if r.get("differs") else ""),
                    r["device"])].append(r)
    if not series:
        return None
    native = len(rows) - sum(len(g) for g in series.values())
    fig = go.Figure()
    for (name, device), group in sorted(series.items()):
        group = sorted(group, key=lambda r: size_sort_key(r["image_size"]))
        fig.add_trace(go.Scatter(
            x=[_side(r["image_size"]) for r in group], y=[r["peak_mb"] for r in group],
            mode="lines+markers", name=f"{name} ({device})",
            marker={"symbol": ["circle" if r["status"] == "ok" else "x" for r in group]},
            customdata=[[size_label(r["image_size"]), r["status"]] for r in group],
            hovertemplate=(f"{name}<br>%{{customdata[0]}} px: %{{customdata[1]}}<br>"
                           "peak %{y:.0f} MB<extra></extra>")))
    if budget_mb:
        fig.add_hline(y=budget_mb, line_dash="dash", annotation_text=f"budget {budget_mb:.0f} MB")
    left_off = f" ({native} native-size run(s) not plotted)" if native else ""
    return _layout(fig, f"Absolute peak memory against resolution{left_off}",
                   "side of the square with the same pixels (px)", "peak MB")


def ratio_chart(rows: Rows) -> go.Figure | None:
    """Each phase's peak over original's, grouped bars per set and size."""
    if not rows:
        return None
    x = [f"{r['name']} {size_label(r['image_size'])} px ({r['device']})" for r in rows]
    fig = _grouped_bars(rows, x, [(p, p) for p in TRAIN_PHASES], "%{y:.3f} x original")
    fig.add_hline(y=1.0, line_dash="dot")
    return _layout(fig, "Peak memory relative to original, per phase", "", "x original",
                   barmode="group")


def largest_size_chart(rows: Rows) -> go.Figure | None:
    """Predicted and found largest square side per set and budget (memstudy maxres)."""
    if not rows:
        return None
    x = [f"{r['name']} @ {r['budget']} ({r['device']})" for r in rows]
    fig = _grouped_bars(rows, x, [("predicted_px", "predicted"), ("found_px", "found")],
                        "%{y} px")
    return _layout(fig, "Largest trainable square size under the budget", "", "px",
                   barmode="group")


def _grouped_bars(rows: Rows, x: list[str], series: list[tuple[str, str]],
                  value: str) -> go.Figure:
    """One bar series per (row key, label), hover '<label>: <value>'."""
    return go.Figure([go.Bar(x=x, y=[r[key] for r in rows], name=label,
                             hovertemplate=f"{label}: {value}<extra></extra>")
                      for key, label in series])


def _side(size: Any) -> float:
    h, w = size_hw(size)
    return (h * w) ** 0.5


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
