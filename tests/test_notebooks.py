"""Every notebook executes on a small results database made on the CPU."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # the test extra; skipped where it is not installed
NotebookClient = pytest.importorskip("nbclient").NotebookClient

from memstudy.maxres import maxres, store_result
from memstudy.runner import execute
from memstudy.store import ResultsDB

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def cpu_db(tmp_path_factory):
    """original and checkpoint at 192 px with validation, and a maxres search whose probes
    (192 and 256 px) give the memory-vs-resolution plot its points."""
    from conftest import small_config

    path = tmp_path_factory.mktemp("nb") / "cpu.sqlite"
    db = ResultsDB(path)
    one_step = dict(max_steps=1, warmup_steps=0)  # that step is measured
    for techniques in ([], ["checkpoint"]):
        assert execute(small_config(192, techniques, **one_step), db).status == "ok"
    cfg = small_config(192, **one_step)
    cfg.budget = "1GiB"
    result = maxres(cfg, [], path, [192, 256], max_size=256, isolate=False)
    assert result.found_px == 256
    store_result(path, cfg, result)
    return path


def test_notebooks_are_committed_without_outputs():
    assert len(NOTEBOOKS) >= 3
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text())["cells"]:
            assert not cell.get("outputs") and not cell.get("execution_count"), path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, cpu_db, monkeypatch):
    monkeypatch.setenv("MEMSTUDY_DB", str(cpu_db))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = json.dumps([o.get("text", "") or o.get("data", {}).get("text/markdown", "") for o in outputs])
    assert str(cpu_db) in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # a plot was drawn


def test_the_documented_command_runs_every_notebook(cpu_db, tmp_path):
    """docs/report.md's `jupyter execute` line, as written, in the environment the README
    makes (a copy of the repository's layout: notebooks/, results/, .venv)."""
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    (line,) = [ln for ln in (root / "docs" / "report.md").read_text().splitlines()
               if "jupyter execute" in ln]
    shutil.copytree(root / "notebooks", tmp_path / "notebooks")
    (tmp_path / "results").mkdir()
    venv = Path(sys.executable).parent.parent  # the .venv these tests run in
    (tmp_path / ".venv").symlink_to(venv)
    command = line.replace("results/quick.sqlite", str(cpu_db))
    proc = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for path in NOTEBOOKS:
        nb = nbformat.read(tmp_path / "results" / path.name, as_version=4)
        outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
        assert outputs and not [o for o in outputs if o.output_type == "error"], path.name
