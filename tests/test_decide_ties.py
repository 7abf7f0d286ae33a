"""The report's decision and Pareto front at their edges (issue 42): ties in memory or time,
a dominated set, a set without a step time, a peak equal to the budget; each kept or left out
in a stated order, whatever order the runs were recorded in."""
from __future__ import annotations

import pytest

from memstudy import report
from memstudy.store import ResultsDB
from test_report_decide import gpu_run

# name: (absolute peak MB = 300 start + forward increment, step s); recorded in this order, so
# that order alone never decides a tie (zeta before alpha, thin before lean). No run has a
# budget, so no CUDA context is measured or added.
SETS = {"zeta": (700, 0.10), "alpha": (700, 0.10),  # equal in both: both on the front
        "mid": (700, 0.20),                          # equal peak, slower: dominated
        "thin": (500, 0.40), "lean": (500, 0.30),    # equal peak: only the faster, lean
        "slow": (600, 0.30),                         # lean's time, larger: dominated
        "bulky": (900, 0.05), "fat": (1000, 0.06)}   # fat: bulky is smaller and faster


@pytest.fixture
def ties(tmp_path):
    db = ResultsDB(tmp_path / "ties.sqlite")
    for name, (peak, step) in SETS.items():
        gpu_run(db, name, 512, peak - 300, step)
    gpu_run(db, "shared", 512, 100, 0.01, others=1)  # 400 MB, timed only beside another run
    return db


def test_the_front_keeps_exact_ties_drops_the_dominated_and_sorts_by_name(ties):
    rows = report.pareto(ties)
    assert [(r["name"], r["pareto"]) for r in rows] == [
        ("lean", "*"), ("thin", ""), ("slow", ""), ("alpha", "*"), ("zeta", "*"), ("mid", ""),
        ("bulky", "*"), ("fat", "")]
    assert [r["peak_mb"] for r in rows] == [500, 500, 600, 700, 700, 700, 900, 1000]


def test_a_set_without_a_step_time_has_no_point_and_beats_no_one(ties):
    """shared (400 MB, the smallest) has no time of its own: not in the table, and lean,
    which it would dominate at any time below 0.30 s, stays on the front."""
    rows = report.pareto(ties)
    assert "shared" not in {r["name"] for r in rows}
    assert next(r for r in rows if r["name"] == "lean")["pareto"] == "*"


def decision(db, budget: str) -> dict:
    (row,) = report.decisions(db, [budget])
    return row


def test_a_peak_equal_to_the_budget_fits_and_a_time_tie_goes_to_the_name(ties):
    row = decision(ties, "700MiB")  # alpha, zeta and mid peak at exactly 700 MB
    assert row["name"] == "alpha" and row["peak_mb"] == 700 and row["fits"] == "6/8"
    assert "not ranked, timed only on a shared GPU: shared" in row["note"]


def test_of_equal_times_the_smaller_peak_wins(ties):
    row = decision(ties, "650MiB")  # lean and slow both 0.30 s; thin slower
    assert (row["name"], row["peak_mb"], row["fits"]) == ("lean", 500, "3/8")


def test_nothing_fits_names_the_smallest_peak_by_name_on_a_tie(ties):
    row = decision(ties, "450MiB")
    assert row["name"] == "(none fits)" and row["fits"] == "0/8"
    # thin and lean both peak at 500 MB; shared (400 MB) was never timed alone
    assert row["note"].startswith("smallest peak 500 MB: lean")
    assert row["note"].endswith("not ranked, timed only on a shared GPU: shared")
