"""Plain-text tables for the terminal, and the per-phase table of one run."""
from __future__ import annotations

from typing import Any, Sequence

from memstudy.byte_sizes import mb
from memstudy.phases import PHASES



def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = lambda vals: "  ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                                  for i, (v, w) in enumerate(zip(vals, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 1e5 else f"{v:.3g}"
    return str(v)


def phase_table(metrics: dict[str, dict[str, float]]) -> str:
    """Per-phase MB table of one run (memory figures in MiB, time in ms); docs/metrics.md."""
    cuda = any("alloc_peak_bytes" in m for m in metrics.values())
    peak, held = ("alloc_peak_bytes", "alloc_held_bytes") if cuda else ("tensor_peak_bytes", "tensor_held_bytes")
    headers = ["phase", "peak MB", "held MB", "saved MB"]
    if cuda:
        headers += ["reserved MB", "NVML MB", "NVML +MB"]
    headers += ["time ms"]
    rows = []
    for phase in PHASES:
        m = metrics.get(phase)
        if not m or "time_s" not in m:
            continue
        row = [phase, mb(m.get(peak)), mb(m.get(held)), mb(m.get("saved_bytes"))]
        if cuda:
            row += [mb(m.get("reserved_peak_bytes")), mb(m.get("nvml_peak_bytes")),
                    mb(m.get("nvml_delta_bytes"))]
        row.append(m["time_s"] * 1e3)
        rows.append(row)
    return format_table(headers, rows)


# -- the same table in other formats (memstudy report) -----------------------------------------
FORMATS = ("term", "md", "csv", "latex", "html")


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str = "term") -> str:
    """One table as terminal text, Markdown, CSV, LaTeX (booktabs) or an HTML <table>."""
    if fmt == "term":
        return format_table(headers, rows)
    cells = [[_cell(v) for v in row] for row in rows]
    if fmt == "md":
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        lines = ["| " + " | ".join(map(esc, headers)) + " |",
                 "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
        return "\n".join(lines + ["| " + " | ".join(map(esc, r)) + " |" for r in cells])
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(headers)
        writer.writerows([["" if v is None else v for v in row] for row in rows])
        return buf.getvalue().rstrip("\n")
    if fmt == "latex":
        spec = "l" + "r" * (len(headers) - 1)
        body = [" & ".join(map(_latex, r)) + r" \\" for r in cells]
        return "\n".join([rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
                          " & ".join(map(_latex, headers)) + r" \\", r"\midrule", *body,
                          r"\bottomrule", r"\end{tabular}"])
    if fmt == "html":
        from html import escape

        head = "".join(f"<th>{escape(h)}</th>" for h in headers)
        body = "".join("<tr>" + "".join(f"<td>{escape(v)}</td>" for v in r) + "</tr>" for r in cells)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    raise ValueError(f"table format {fmt!r} unknown; choose one of {FORMATS}")


_LATEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
          "_": r"\_", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def _latex(text: str) -> str:
    return "".join(_LATEX.get(c, c) for c in text)
