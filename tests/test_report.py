"""memstudy report: tables from a database, every format, an offline HTML file."""
from __future__ import annotations

import csv
import io
import re

import pytest

from memstudy import report
from memstudy.cli import main
from memstudy.store import ResultsDB, RunRecord
from report_html import network_references

MB = 1024**2


def record(db: ResultsDB, name: str, size: int, fwd: float, bwd: float, step: float,
           status: str = "ok", phase: str | None = None, seed: int = 0, val: float = 0.3) -> None:
    """A CPU run as the runner stores it: tensor-meter phase figures (bytes), one epoch."""
    metrics = [(0, p, k, v) for p, mbs in (("forward", fwd), ("backward", bwd), ("step", step))
               for k, v in (("tensor_peak_bytes", mbs * MB), ("tensor_start_bytes", 100 * MB),
                            ("time_s", 0.1))]
    metrics.append((0, "run", "step_time_s", 0.5))
    db.record(RunRecord(config={"train": {"image_size": size, "batch_size": 1, "seed": seed},
                                "techniques": [] if name == "original" else name.split("+"),
                                "world_size": 1},
                        config_hash=f"{name}{size}{seed}{status}", name=name, status=status,
                        env={"device": "cpu"}, started_at=0.0, failed_phase=phase,
                        metrics=metrics if status == "ok" else [],
                        epochs=[{"epoch": 0, "steps": 2, "train_loss": 0.5, "val_loss": val,
                                 "val_ssim": 0.8, "val_psnr": 20.0, "time_s": 1.0}]
                        if status == "ok" else []))


@pytest.fixture
def db(tmp_path):
    db = ResultsDB(tmp_path / "r.sqlite")
    record(db, "original", 512, 800, 400, 100)
    record(db, "original", 512, 600, 400, 100, seed=1, val=0.5)  # seeds are averaged
    record(db, "amp:bf16", 512, 350, 100, 100)
    record(db, "checkpoint", 512, 280, 640, 100)
    record(db, "original", 1024, 0, 0, 0, status="oom", phase="backward")
    return db


def test_tables_group_average_and_compare_with_original(db):
    rows = {(r["name"], r["image_size"]): r for r in report.phase_memory(db)}
    orig = rows["original", 512]
    assert (orig["forward_mb"], orig["backward_mb"], orig["runs"]) == (700, 400, 2)
    assert orig["peak_total_mb"] == 800  # mean over seeds of start (100 MB) + largest phase peak
    assert rows["original", 1024]["status"] == "oom in backward"
    ratios = {r["name"]: r for r in report.memory_ratios(db)}
    assert ratios["amp:bf16"]["forward"] == pytest.approx(0.5)
    assert ratios["checkpoint"]["backward"] == pytest.approx(1.6)
    assert "original" not in ratios
    loss = {r["name"]: r for r in report.losses(db)}
    assert loss["original"]["val_loss"] == pytest.approx(0.4)
    assert [r["image_size"] for r in report.phase_memory(db, 1024)] == [1024]


def test_formats(db):
    term = report.build_report(db, "term")
    assert "Forward MB" in term and "oom in backward" in term
    md = report.render("phase_memory", report.phase_memory(db), "md")
    assert md.splitlines()[0].startswith("| techniques |") and "| amp:bf16 |" in md
    rows = list(csv.reader(io.StringIO(report.render("phase_memory", report.phase_memory(db), "csv"))))
    assert rows[0][0] == "techniques" and float(rows[1][4]) in (350.0, 700.0, 280.0)
    latex = report.render("memory_ratios", report.memory_ratios(db), "latex")
    assert r"\begin{tabular}" in latex and r"amp:bf16" in latex
    marked = [line[2:] for line in report.build_report(db, "csv").splitlines() if line.startswith("# ")]
    # 4 study tables, 4 of the decision and, without a budget, the activation memory per set
    assert sum(line in report.TITLES.values() for line in marked) == 9


def test_html_is_one_offline_file(db, tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", str(db.path), "--format", "html", "--out", str(out), "--budget", "1GiB"]) == 0
    html = out.read_text()
    assert html.count('class="plotly-graph-div"') >= 2  # ratio chart and resolution chart
    assert network_references(html) == []


def test_missing_database_is_refused(tmp_path, capsys):
    assert main(["report", str(tmp_path / "none.sqlite")]) == 2
    assert "not found" in capsys.readouterr().err


def test_tri_accel_section_only_with_tri_accel_runs(db, make_config, tmp_path):
    from memstudy.runner import execute
    from memstudy.techniques.tri_accel.score import run_efficiency
    from memstudy.techniques.tri_accel.precision import LEVELS

    assert "Tri-Accel" not in report.build_report(db, "md")  # no tri_accel run: no section
    tri = ResultsDB(tmp_path / "tri.sqlite")
    for techniques in ([], ["tri_accel:low=bf16:t_ctrl=1:t_curv=2:power_iters=1:max_batch=1"]):
        cfg = make_config(64, techniques=techniques, msssim_scales=1)  # the smallest image
        cfg.budget = "2GiB"  # the elastic batch needs a capacity on the CPU
        cfg.data.train_images = 3
        assert execute(cfg, tri).status == "ok"
    base, run = tri.runs()
    rows = report.tri_efficiency(tri)
    assert [r["run"] for r in rows] == [base["id"], run["id"]]  # the fp32 run is the baseline
    for r in rows:
        assert r["score"] == pytest.approx(run_efficiency(tri, r["run"])["score"])
    assert rows[1]["score"] > 0 and rows[1]["tri_accel"] and not rows[0]["tri_accel"]
    md = report.build_report(tri, "md")
    assert "## Tri-Accel efficiency score" in md and f"{rows[1]['score']:.3f}" in md
    marked = [line[2:] for line in report.build_report(tri, "csv").splitlines() if line.startswith("# ")]
    assert sum(line in report.TITLES.values() for line in marked) == 9  # 4 + 4 + Tri-Accel
    series = report.tri_control_series(tri, run["id"])
    assert series["levels"] == list(LEVELS) and series["units"][0] == "stem"
    assert len(series["precision"]["stem"]) == 3 and series["lambda_max"]["head"]
    assert series["mem_capacity_mb"][0][1] == 2048 and series["batch_size"]
    html = report.build_report(tri, "html")
    assert "Tri-Accel control steps" in html and f"run {run['id']}: tri_accel" in html
    assert html.count("<img alt=\"Tri-Accel controls") == 1  # one tri run: its controls (PNG)


MIXED_SIZES = (256, "200x296", "native")  # square int, rectangle "HxW", folder data at native size


@pytest.fixture
def mixed_db(tmp_path):
    """Runs of every stored size form in one database, as a study mixing them records it."""
    db = ResultsDB(tmp_path / "mixed.sqlite")
    for size in MIXED_SIZES:
        record(db, "original", size, 800, 400, 100)
        record(db, "amp:bf16", size, 350, 100, 100)
    for size in ("4188x3500", 8192):  # two failed sizes of two forms on one line of a plot
        record(db, "original", size, 0, 0, 0, status="oom", phase="forward")
    return db


def test_sizes_of_every_form_read_back_as_recorded(mixed_db):
    stored = [r["image_size"] for r in mixed_db.runs()]
    assert stored == [256, 256, "200x296", "200x296", "native", "native", "4188x3500", 8192]


def test_mixed_size_forms_sort_by_pixels_with_native_last(mixed_db):
    sizes = [r["image_size"] for r in report.phase_memory(mixed_db) if r["name"] == "original"]
    assert sizes == ["200x296", 256, "4188x3500", 8192, "native"]  # 59200 < 65536 px <...< native
    assert [r["image_size"] for r in report.memory_ratios(mixed_db)] == ["200x296", 256, "native"]


@pytest.mark.parametrize("fmt", ["term", "md", "csv", "latex", "html"])
def test_report_of_mixed_size_forms_in_every_format(mixed_db, tmp_path, fmt):
    out = tmp_path / f"report.{fmt}"
    assert main(["report", str(mixed_db.path), "--format", fmt, "--out", str(out)]) == 0
    text = re.sub(r"data:image/png;base64,[^\"]*", "", out.read_text())  # digits in base64
    for size in (*MIXED_SIZES, "4188x3500", 8192):
        assert re.search(rf"(?<![\dx]){size}(?![\dx])", text), f"size {size} missing from {fmt}"
    if fmt == "html":  # ratio chart and resolution chart both drawn
        html = out.read_text()
        assert 'class="plotly-graph-div"' in html and "2 native-size run(s) not plotted" in html


def test_resolution_chart_places_rectangles_by_pixels_and_leaves_native_off(mixed_db):
    fig = report.resolution_chart(report.memory_vs_resolution(mixed_db))
    ax = fig.axes[0]
    xs = sorted({x for line in ax.lines for x in line.get_xdata()})
    assert xs == pytest.approx(sorted([(200 * 296) ** 0.5, 256, (4188 * 3500) ** 0.5, 8192]), rel=1e-9)
    assert "2 native-size run(s) not plotted" in ax.get_title()
    assert {t.get_text() for t in ax.texts} == {"200x296", "4188x3500"}


def test_phase_memory_notebook_with_mixed_size_forms(mixed_db, monkeypatch):
    """notebooks/01_phase_memory.ipynb shows one table per size; its loop sorts the sizes."""
    from pathlib import Path

    nbformat = pytest.importorskip("nbformat")
    client = pytest.importorskip("nbclient")
    path = Path(__file__).resolve().parents[1] / "notebooks" / "01_phase_memory.ipynb"
    monkeypatch.setenv("MEMSTUDY_DB", str(mixed_db.path))
    nb = nbformat.read(path, as_version=4)
    client.NotebookClient(nb, timeout=120, kernel_name="python3",
                          resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    headings = [line for o in outputs for line in o.get("data", {}).get("text/markdown", "").splitlines()
                if line.startswith("### ")]
    assert headings == ["### 200x296 px", "### 256 px", "### 4188x3500 px", "### 8192 px",
                        "### native px"]
