"""The published figures agree with their record.

benchmarks/results/summary.json holds the headline figures, each with its GPU, date, result
file and the places that quote it. These tests read that file (nothing here names a figure):
every quote appears where the summary says, carries the figure's value, and the result file
holds the figure; every results path a page names exists, and every result file is named by
a page (a file no page points to is removed, git keeps it).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SUMMARY = json.loads((RESULTS / "summary.json").read_text())
HEADLINES = SUMMARY["headlines"]
# pages that cite result files (docs/techniques/tile.md and offload.md are updated with the
# tiling measurements they describe)
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "BENCHMARKS.md",
         *sorted((ROOT / "docs").rglob("*.md"))]
PENDING_PAGES: set[str] = set()
RESULT_PATH = re.compile(r"results/((?:cpu|h[0-9]+(?:x[0-9]+)?)/[A-Za-z0-9_./-]+)")


@pytest.mark.parametrize("key", sorted(HEADLINES))
def test_each_headline_is_recorded_with_its_source(key):
    entry = HEADLINES[key]
    for field in ("what", "value", "gpu", "date", "result", "quoted_in"):
        assert entry.get(field), f"summary.json: {key} lacks {field}"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", entry["date"]), f"{key}: date {entry['date']!r}"
    result = ROOT / entry["result"]
    assert result.is_file(), f"{key}: result file {entry['result']} is missing"
    figure = entry.get("in_result", entry["value"])
    assert figure in result.read_text(errors="replace"), \
        f"{key}: {entry['result']} does not hold {figure!r}"


@pytest.mark.parametrize("key", sorted(HEADLINES))
def test_each_headline_is_quoted_as_recorded(key):
    entry = HEADLINES[key]
    for page, quote in entry["quoted_in"].items():
        assert entry["value"] in quote, f"{key}: the quote for {page} does not contain {entry['value']}"
        text = " ".join((ROOT / page).read_text().split())
        assert " ".join(quote.split()) in text, \
            f"{page} no longer quotes {key} as {quote!r} (summary.json: {entry['value']})"


def test_the_readme_and_the_results_page_quote_the_headlines():
    quoted = {page for entry in HEADLINES.values() for page in entry["quoted_in"]}
    assert {"README.md", "benchmarks/BENCHMARKS.md"} <= quoted


def _cited(page: Path) -> set[str]:
    return {m.rstrip(".,:;)`") for m in RESULT_PATH.findall(page.read_text())}


def test_every_results_path_a_page_names_exists():
    missing = [f"{page.relative_to(ROOT)}: results/{path}" for page in PAGES
               if page.relative_to(ROOT).as_posix() not in PENDING_PAGES
               for path in _cited(page) if not (RESULTS / path).exists()]
    assert not missing, "pages name results that do not exist:\n" + "\n".join(missing)


def _names(text: str, path: Path) -> bool:
    """Whether `text` points to the result file `path`: by its path without the suffix (a
    table's .md, .json and .sqlite are one result), by its folder cited whole, or by its
    folder and its name."""
    rel = path.relative_to(RESULTS).with_suffix("").as_posix()
    folder = path.parent.relative_to(RESULTS).as_posix() + "/"
    return (f"results/{rel}" in text or f"results/{folder}`" in text
            or (f"results/{folder}" in text and path.name in text))


def test_every_result_file_is_named_by_a_page():
    texts = [page.read_text() for page in PAGES]
    unnamed = [path.relative_to(RESULTS).as_posix() for path in sorted(RESULTS.rglob("*"))
               if path.is_file() and path.parent != RESULTS
               and not any(_names(text, path) for text in texts)]
    assert not unnamed, "result files no page points to (remove them or cite them):\n" \
        + "\n".join(unnamed)
