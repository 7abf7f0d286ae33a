"""The report answers its question on the CPU: a decision section that is not empty without a
budget (what it needs, a budget that splits the runs, the activation memory per set), Pareto
points named, a warning on quality from too few epochs or seeds, budgets as written."""
from __future__ import annotations

import pytest

from memstudy import advise, report
from memstudy.report.notes import QUALITY_MIN_EPOCHS, QUALITY_MIN_SEEDS
from memstudy.store import ResultsDB, RunRecord

MB = 1024**2
STATE_MB = 370  # parameters + gradients + Adam moments: the same for every set


def cpu_run(db: ResultsDB, name: str, size: int, saved_mb: float, seed: int = 0,
            epochs: int = 1) -> None:
    """A CPU run as the runner stores it: tensor-meter phases over the model state, the
    forward's saved tensors as a category, `epochs` epochs."""
    metrics = [(0, "forward", "cat_saved_bytes", saved_mb * MB), (0, "run", "step_time_s", 0.5)]
    for phase, inc in (("forward", saved_mb + 5), ("backward", saved_mb / 2), ("step", 18)):
        metrics += [(0, phase, "tensor_start_bytes", STATE_MB * MB),
                    (0, phase, "tensor_peak_bytes", inc * MB),
                    (0, phase, "cat_params_bytes", STATE_MB / 4 * MB),
                    (0, phase, "cat_optimizer_bytes", STATE_MB / 2 * MB)]
    db.record(RunRecord(
        config={"train": {"image_size": size, "batch_size": 1, "seed": seed, "epochs": epochs},
                "data": {"seed": seed}, "techniques": [] if name == "original" else [name],
                "world_size": 1},
        config_hash=f"{name}{size}{seed}{epochs}", name=name, status="ok", env={"device": "cpu"},
        started_at=0.0, metrics=metrics,
        epochs=[{"epoch": e, "steps": 6, "train_loss": 0.4, "val_loss": 0.5 - e / 1000 - seed / 100,
                 "val_ssim": 0.5, "val_psnr": 10.0, "time_s": 1.0} for e in range(epochs)]))


@pytest.fixture
def quick(tmp_path):
    """The quick study's shape: five sets at two sizes, one epoch, one seed, no budget."""
    db = ResultsDB(tmp_path / "quick.sqlite")
    for size, scale in ((192, 1.0), (256, 1.8)):
        for name, saved in (("original", 50), ("amp", 70), ("checkpoint", 15), ("tile", 7),
                            ("invertible", 43)):
            cpu_run(db, name, size, saved * scale)
    return db


def section(text: str, title_start: str) -> list[str]:
    blocks = text.split("\n\n")
    (block,) = [b for b in blocks if b.startswith(title_start)]
    return block.splitlines()[1:]


def test_without_a_budget_the_decision_says_what_it_needs_and_what_the_runs_answer(quick):
    text = report.build_report(quick, "term")
    (line,) = section(text, "Best technique set")
    assert line != "(no runs)" and "no budget" in line and str(quick.path) in line
    budget = line.split("--budget ")[1].split(",")[0]
    decided = report.decisions(quick, [budget])  # the suggested budget splits the sets
    largest = [r for r in decided if r["image_size"] == 256]
    assert largest and all(r["fits"] not in ("0/5", "5/5") for r in largest)
    rows = {(r["name"], r["image_size"]): r for r in report.savings(quick)}
    assert rows["checkpoint", 256]["saved_mb_x"] == pytest.approx(15 / 50)
    assert rows["checkpoint", 256]["state_mb"] == pytest.approx(STATE_MB * 3 / 4)
    assert "Activation memory per set" in text and "saved for backward MB" in text


def test_with_a_budget_the_decision_ranks_and_the_savings_give_way(quick):
    text = report.build_report(quick, "term", budget="1GiB")
    assert "no budget" not in text and "Activation memory per set" not in text
    assert "1GiB" in "\n".join(section(text, "Best technique set"))


def test_quality_from_too_few_epochs_or_seeds_is_named_under_its_table(quick, tmp_path):
    text = report.build_report(quick, "term")
    for title in ("Loss (1 - MS-SSIM)", "Peak memory against step time"):
        (warning,) = [x for x in section(text, title) if x.startswith("warning:")]
        assert "1 epoch(s) and 1 seed(s)" in warning and "docs/metrics.md" in warning
    enough = ResultsDB(tmp_path / "enough.sqlite")
    for seed in range(QUALITY_MIN_SEEDS):
        for name in ("original", "checkpoint"):
            cpu_run(enough, name, 192, 20, seed=seed, epochs=QUALITY_MIN_EPOCHS)
    assert "warning:" not in report.build_report(enough, "term", budget="1GiB")
    cpu_run(enough, "amp", 192, 20, epochs=QUALITY_MIN_EPOCHS)  # one seed of a third set
    assert "as few as 10 epoch(s) and 1 seed(s)" in report.build_report(enough, "term")


def test_pareto_points_name_their_set(quick):
    from memstudy.report.interactive import pareto_chart

    rows = report.pareto(quick)
    fig = pareto_chart(rows, "cpu")
    named = {text for trace in fig.data if "text" in trace.mode for text in trace.text}
    assert named == {r["name"] for r in rows}


def test_advise_on_the_cpu_speaks_of_tensor_bytes_not_a_cuda_context(quick):
    device, preds, _skipped = advise.predict_all(quick, "1GiB", 224)
    text = advise.describe(device, 224, "1GiB", preds)
    assert device == "cpu" and "CUDA" not in text and "live tensor bytes" in text
