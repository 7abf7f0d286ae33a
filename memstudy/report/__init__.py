"""Reports of a results database: the study's tables and figures, for `memstudy report` and notebooks.

Python API (all take a database path or a ResultsDB; rows are lists of dicts, pandas-free):
    phase_memory(db, image_size=None)   Tables 2/4/6: Forward / Backward / Step MB, time
    losses(db, image_size=None)         Table 1: train / validation loss, SSIM, PSNR
    memory_ratios(db)                   Fig. 2: memory / original per phase
    memory_vs_resolution(db)            peak MB of every run by size (maxres probes included)
    largest_size(db)                    memstudy maxres results: predicted and found size
    loss_curves(db, image_size=None)    per-step training loss of every finished run
    ratio_chart, resolution_chart, largest_size_chart, loss_curve_chart -> matplotlib Figure;
    png(fig) -> PNG bytes (IPython.display.Image(png(fig)) in a notebook)
    render(table_name, rows, fmt)       one table as term / md / csv / latex / html
    tri_efficiency(db), tri_control_series(db, run_id), tri_control_chart(series)
                                        Tri-Accel section (only for databases with tri_accel runs)
    decisions(db, budgets)              per budget and size: the fastest set that fits, its costs
    savings(db)                         per set and size: activation memory against original
                                        (shown in place of decisions when there is no budget)
    pareto(db)                          peak memory against step time per size, Pareto marked
    phase_categories(db), phase_peaks(db)
                                        memory by category per phase; increment beside absolute
    budgets_found(db, extra)            the budgets of the database's runs and searches (bytes)
    build_report(db, fmt)               everything, as `memstudy report` prints it
    notebook_db()                       $MEMSTUDY_DB, else benchmarks/results/h200/technique-grid/gpu.sqlite
"""
from __future__ import annotations

import os
from pathlib import Path

from memstudy.report import cost as cost_section
from memstudy.report import decide
from memstudy.report import savings as savings_section
from memstudy.report.notes import table_note
from memstudy.report.decide import (budgets_found, candidates, decisions, pareto,
                                    phase_categories, phase_peaks)
from memstudy.report.savings import savings
from memstudy.report.cost import accumulation, cost, parse_weights
from memstudy.report.data import load_maxres, load_runs, open_db
from memstudy.report.plots import (largest_size_chart, loss_curve_chart, png, ratio_chart,
                                   resolution_chart, tri_control_chart)
from memstudy.report.tables import (COLUMNS, TABLES, TITLES, as_cells, largest_size, loss_curves,
                                    losses, memory_ratios, memory_vs_resolution, phase_memory,
                                    spellings)
from memstudy.report.triaccel_section import control_series as tri_control_series
from memstudy.report.triaccel_section import efficiency as tri_efficiency
from memstudy.report.triaccel_section import tri_runs
from memstudy.text_table import FORMATS, render_table
from memstudy.byte_sizes import mb, parse_bytes

GPU_DB = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200" / "technique-grid" / "gpu.sqlite"


def notebook_db() -> Path:
    """The database the notebooks read: $MEMSTUDY_DB, else the GPU benchmark database."""
    return Path(os.environ.get("MEMSTUDY_DB") or GPU_DB)


def render(table: str, rows: list[dict], fmt: str = "term") -> str:
    return render_table(*as_cells(table, rows, raw=fmt == "csv"), fmt)


def budget_line(resolution: list[dict], budget: str | None = None) -> float | None:
    """The budget to draw: the one given, else the one every budgeted run shares."""
    if budget:
        return mb(parse_bytes(budget, "budget"))
    budgets = {r["budget_mb"] for r in resolution if r["budget_mb"]}
    return budgets.pop() if len(budgets) == 1 else None


COLUMNS.update(cost_section.COLUMNS)
TITLES.update(cost_section.TITLES)
COLUMNS.update(decide.COLUMNS)
TITLES.update(decide.TITLES)
COLUMNS.update(savings_section.COLUMNS)
TITLES.update(savings_section.TITLES)


def build_report(db, fmt: str = "term", budget: str | None = None,
                 cost_weights: tuple[float, float, float] | None = None) -> str:
    """Every table; the cost objective (eq. 3) when `cost_weights` are given or a run recorded
    a time to target, the accumulation table (eq. 9) when the database holds accumulate runs."""
    if fmt not in FORMATS:
        raise ValueError(f"report format {fmt!r} unknown; choose one of {FORMATS}")
    db = open_db(db)
    # the decision first: what a reader came for; then the study's tables behind it
    budgets = budgets_found(db) + ([budget] if budget else [])
    tables = {"decisions": decisions(db, budgets)}
    empty: dict[str, str] = {}
    if not budgets:  # what the runs answer without one (memstudy.report.savings)
        tables["savings"] = savings_section.savings(db)
        empty["decisions"] = savings_section.needs(tables["savings"], str(db.path))
    tables.update({name: fn(db) for name, fn in TABLES.items()})
    tables.update({name: fn(db) for name, fn in decide.TABLES.items() if name != "decisions"})
    costs = cost(db, cost_weights or cost_section.DEFAULT_WEIGHTS)
    if cost_weights or any(r["time_to_target_s"] is not None for r in costs):
        tables["cost"] = costs
    accumulated = accumulation(db)
    if accumulated:
        tables["accumulation"] = accumulated
    tri = tri_efficiency(db)  # [] unless the database holds tri_accel runs
    if tri:
        tables["tri_efficiency"] = tri
    if fmt == "html":
        from memstudy.report.html import build_html

        resolution = memory_vs_resolution(db)
        controls = [(run, tri_control_series(db, run["id"])) for run in tri_runs(db)] if tri else []
        return build_html(str(db.path), tables, resolution, budget_line(resolution, budget),
                          controls, {n: table_note(n, rows, empty) for n, rows in tables.items()})
    heading = {"term": "{}\n", "md": "## {}\n\n", "csv": "# {}\n", "latex": "% {}\n"}[fmt]
    mark = {"term": "", "md": "", "csv": "# ", "latex": "% "}[fmt]
    sections = [heading.format(TITLES[name]) + "\n".join(filter(None, (
                    render(name, rows, fmt) if rows else "",
                    mark + table_note(name, rows, empty) if table_note(name, rows, empty) else "")))
                for name, rows in tables.items()]
    return "\n\n".join(sections + spelling_note(db, fmt)) + "\n"


def spelling_note(db, fmt: str) -> list[str]:
    """One line per technique set recorded under several spellings, which the tables merge."""
    merged = spellings(load_runs(db))
    mark = {"term": "", "md": "", "csv": "# ", "latex": "% "}[fmt]
    return [f"{mark}note: {shown} is also recorded as {', '.join(names[1:])}: the same technique "
            f"set spelled differently (one config hash), shown once as {shown}"
            for shown, names in merged.items()]


__all__ = ["COLUMNS", "TABLES", "TITLES", "accumulation", "budgets_found", "build_report",
           "candidates", "cost", "decisions", "pareto", "phase_categories", "phase_peaks", "parse_weights", "savings", "budget_line", "largest_size",
           "largest_size_chart", "load_maxres", "load_runs", "loss_curve_chart", "loss_curves", "losses", "memory_ratios",
           "memory_vs_resolution", "notebook_db", "open_db", "phase_memory", "png",
           "ratio_chart", "render", "resolution_chart", "tri_control_chart",
           "tri_control_series", "tri_efficiency"]
