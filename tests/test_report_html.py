"""The interactive HTML report: one offline file that a real browser renders without errors."""
from __future__ import annotations

import re

import pytest

from memstudy.cli import main
from report_html import CHROMIUM, console_errors, network_references, render
from test_report_decide import db  # noqa: F401 (the fixture database)


@pytest.fixture
def html_file(db, tmp_path):  # noqa: F811
    out = tmp_path / "report.html"
    assert main(["report", str(db.path), "--format", "html", "--budget", "1GiB", "--out", str(out)]) == 0
    return out


def test_no_network_reference(html_file):
    html = html_file.read_text()
    assert network_references(html) == []
    assert not re.search(r"<script[^>]*\bsrc=", html) and "<link" not in html  # all inline
    assert network_references('<script src="https://cdn.plot.ly/x.js"></script>')  # the check bites


def test_plots_hold_their_data_and_tables_sort(html_file):
    html = html_file.read_text()
    divs = html.count('class="plotly-graph-div"')
    assert divs >= 4  # Pareto, categories (512 and 1024 px), resolution
    assert '"hovertemplate"' in html and 'table class="sortable"' in html


def test_every_section_is_listed_and_linked(html_file):
    """The contents at the top link to every h2, and every h2 has the anchor linked."""
    html = html_file.read_text()
    anchors = re.findall(r'<h2 id="([^"]+)">', html)
    assert len(anchors) == html.count("<h2") and "pareto" in anchors and "resolution" in anchors
    nav = html[html.index("<nav>"):html.index("</nav>")]
    assert re.findall(r'<a href="#([^"]+)">', nav) == anchors


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary installed")
def test_renders_in_headless_chromium_without_script_errors(html_file, tmp_path):
    dom, log = render(html_file, tmp_path / "profile")
    divs = html_file.read_text().count('class="plotly-graph-div"')
    assert dom.count('class="main-svg"') >= divs, "a plot did not render"
    assert not re.search(r"<html[^>]*data-script-errors", dom), "a script raised an error"
    assert console_errors(log) == []


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary installed")
def test_the_browser_check_sees_a_script_error(html_file, tmp_path):
    broken = tmp_path / "broken.html"
    broken.write_text(html_file.read_text().replace("<body>", "<body><script>nosuch();</script>", 1))
    dom, log = render(broken, tmp_path / "profile")
    assert re.search(r'<html[^>]*data-script-errors="1"', dom) and console_errors(log)
