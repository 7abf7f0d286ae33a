"""One self-contained, offline, interactive HTML report.

Everything the page needs is inside the file: Plotly's JavaScript (from the installed
`plotly` package, inlined once: the file is about 5 MB, the price of opening offline with
hover values and legend toggling), each figure's data, a few lines of script that sort a
table by the column clicked, and the CSS. No script, stylesheet, font or image is loaded from
the network. A first small script counts script errors on the root element
(`data-script-errors`), so a headless browser can check that the page rendered cleanly.
The Tri-Accel control figures stay matplotlib PNGs (base64): many panels of many runs.
"""
from __future__ import annotations

import base64
import time
from html import escape
from typing import Any

import memstudy.report.interactive as interactive
import memstudy.report.plots as plots
from memstudy.report.tables import TITLES, as_cells
from memstudy.image_sizes import size_sort_key
from memstudy.text_table import render_table

RESOLUTION_TITLE = "Memory vs resolution"
STYLE = """body{font-family:sans-serif;margin:2em;max-width:90em}
table{border-collapse:collapse;margin:0.5em 0 1.5em}
th,td{border:1px solid #bbb;padding:0.2em 0.6em;text-align:left;overflow-wrap:break-word}
td.num{text-align:right;white-space:nowrap}
thead{background:#eee}th{cursor:pointer}th.asc::after{content:" \\25B2"}
th.desc::after{content:" \\25BC"}img{max-width:100%}"""

# Counts script errors before anything else runs (a headless browser reads the attribute).
ERROR_COUNTER = """window.memstudyErrors=[];window.addEventListener('error',function(e){
memstudyErrors.push(String(e.message));
document.documentElement.setAttribute('data-script-errors',memstudyErrors.length);});"""

# Numbers right-aligned; click a header to sort its table by that column (numbers by value,
# '-' last), again to reverse.
SORTER = """document.querySelectorAll('table.sortable td').forEach(function(td){
if(/^[-+]?[0-9.]+( |$)/.test(td.textContent.trim()))td.classList.add('num');});
document.querySelectorAll('table.sortable th').forEach(function(th,col){
th.title='click to sort';th.addEventListener('click',function(){
var body=th.closest('table').tBodies[0],rows=Array.from(body.rows);
var dir=th.classList.contains('asc')?-1:1;
th.parentNode.querySelectorAll('th').forEach(function(h){h.classList.remove('asc','desc');});
th.classList.add(dir>0?'asc':'desc');
function key(r){var t=r.cells[col].textContent.trim(),n=parseFloat(t);
return t==='-'||t===''?null:(isNaN(n)||!/^[-+]?[0-9.]/.test(t)?t:n);}
rows.sort(function(a,b){var x=key(a),y=key(b);if(x===null)return 1;if(y===null)return -1;
if(typeof x===typeof y)return (x<y?-1:x>y?1:0)*dir;return (typeof x==='number'?-1:1)*dir;});
rows.forEach(function(r){body.appendChild(r);});});});"""


def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def _figure(fig) -> str:
    if fig is None:
        return ""
    return fig.to_html(full_html=False, include_plotlyjs=False,
                       config={"displaylogo": False, "responsive": True})


def _img(fig, alt: str) -> str:
    data = base64.b64encode(plots.png(fig)).decode()
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def _table(name: str, rows: list[dict[str, Any]], note: str = "") -> str:
    note = f"<p>{escape(note)}</p>" if note else ""
    if not rows:
        return note or "<p>no runs</p>"
    return render_table(*as_cells(name, rows), "html").replace(
        "<table>", '<table class="sortable">', 1) + note


def build_html(source: str, tables: dict[str, list[dict[str, Any]]], resolution: list[dict],
               budget_mb: float | None, tri_controls: list[tuple[dict, dict]] = (),
               notes: dict[str, str] | None = None) -> str:
    """`tri_controls`: (run, control_series) per Tri-Accel run, plotted after the
    `tri_efficiency` table (memstudy.report.triaccel_section); `notes`: the line under each
    table (memstudy.report.notes)."""
    notes = notes or {}
    parts = [f"<h1>memstudy report</h1><p>{escape(source)} &middot; generated "
             f"{time.strftime('%Y-%m-%d %H:%M')} &middot; click a column header to sort, "
             "a legend entry to hide or show a series, hover a point for its values</p>",
             _contents([(name, TITLES[name]) for name in tables] + [("resolution", RESOLUTION_TITLE)])]
    for name, rows in tables.items():
        parts.append(f'<h2 id="{name}">{escape(TITLES[name])}</h2>')
        parts.append(_table(name, rows, notes.get(name, "")))
        parts.append(_figures_after(name, rows))
        if name == "tri_efficiency":
            parts.append(_tri_runs(tri_controls))
    parts.append(f'<h2 id="resolution">{escape(RESOLUTION_TITLE)}</h2>')
    parts.append(_figure(interactive.resolution_chart(resolution, budget_mb)) or "<p>no runs</p>")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>memstudy report</title>"
            f"<style>{STYLE}</style><script>{ERROR_COUNTER}</script>"
            f"<script>{_plotly_js()}</script></head><body>{''.join(parts)}"
            f"<script>{SORTER}</script></body></html>")


def _contents(sections: list[tuple[str, str]]) -> str:
    """A list of the (anchor, title) sections, each linking to its heading (report.html#pareto
    opens there)."""
    items = "".join(f'<li><a href="#{anchor}">{escape(title)}</a></li>' for anchor, title in sections)
    return f"<nav><ul>{items}</ul></nav>"


def _figures_after(name: str, rows: list[dict[str, Any]]) -> str:
    """The figures that belong below a table."""
    if not rows:
        return ""
    if name == "pareto":
        return "".join(_figure(interactive.pareto_chart(rows, d))
                       for d in sorted({r["device"] for r in rows}))
    if name == "phase_categories":
        keys = sorted({(r["device"], r["image_size"]) for r in rows},
                      key=lambda k: (k[0], size_sort_key(k[1])))
        return "".join(_figure(interactive.category_chart(rows, d, s)) for d, s in keys)
    if name == "savings":
        return _figure(interactive.savings_chart(rows))
    if name == "memory_ratios":
        return _figure(interactive.ratio_chart(rows))
    if name == "largest_size":
        return _figure(interactive.largest_size_chart(rows))
    return ""


def _tri_runs(controls) -> str:
    parts = ["<h3>Tri-Accel control steps</h3><p>Per run: precision per unit, top Hessian "
             "eigenvalue and learning rate per unit, batch size, memory used vs capacity.</p>"]
    for run, series in controls:
        title = f"run {run['id']}: {run['name']}, {run['image_size']} px"
        parts.append(f"<h4>{escape(title)}</h4>")
        parts.append(_img(plots.tri_control_chart(series, title), f"Tri-Accel controls, {title}"))
    return "".join(parts)
