"""One self-contained, offline HTML report: inline CSS, plots embedded as base64 PNGs.

Nothing is loaded from the network: no external stylesheet, script, font or image.
"""
from __future__ import annotations

import base64
import time
from html import escape
from typing import Any

from memstudy.report import plots
from memstudy.report.tables import TITLES, as_cells
from memstudy.text_table import render_table

STYLE = """body{font-family:sans-serif;margin:2em;max-width:80em}
table{border-collapse:collapse;margin:0.5em 0 1.5em}
th,td{border:1px solid #bbb;padding:0.2em 0.6em;text-align:right}
th:first-child,td:first-child{text-align:left}
thead{background:#eee}img{max-width:100%}"""


def _img(fig, alt: str) -> str:
    data = base64.b64encode(plots.png(fig)).decode()
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def build_html(source: str, tables: dict[str, list[dict[str, Any]]], resolution: list[dict],
               budget_mb: float | None, tri_controls: list[tuple[dict, dict]] = ()) -> str:
    """`tri_controls`: (run, control_series) per Tri-Accel run, plotted after the
    `tri_efficiency` table (memstudy.report.triaccel_section)."""
    parts = [f"<h1>memstudy report</h1><p>{escape(source)} &middot; generated "
             f"{time.strftime('%Y-%m-%d %H:%M')}</p>"]
    for name, rows in tables.items():
        parts.append(f"<h2>{escape(TITLES[name])}</h2>")
        parts.append(render_table(*as_cells(name, rows), "html") if rows else "<p>no runs</p>")
        if name == "memory_ratios" and rows:
            parts.append(_img(plots.ratio_chart(rows), "memory ratio vs original per phase"))
        if name == "largest_size" and rows:
            parts.append(_img(plots.largest_size_chart(rows), "largest trainable size"))
        if name == "tri_efficiency":
            parts.append(_tri_runs(tri_controls))
    parts.append("<h2>Memory vs resolution</h2>")
    parts.append(_img(plots.resolution_chart(resolution, budget_mb), "memory vs resolution")
                 if resolution else "<p>no runs</p>")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>memstudy report</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>")


def _tri_runs(controls) -> str:
    parts = ["<h3>Tri-Accel control steps</h3><p>Per run: precision per unit, top Hessian "
             "eigenvalue and learning rate per unit, batch size, memory used vs capacity.</p>"]
    for run, series in controls:
        title = f"run {run['id']}: {run['name']}, {run['image_size']} px"
        parts.append(f"<h4>{escape(title)}</h4>")
        parts.append(_img(plots.tri_control_chart(series, title), f"Tri-Accel controls, {title}"))
    return "".join(parts)
