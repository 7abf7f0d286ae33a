"""advise over a fixture of exactly three sizes per technique set (issue 42): the fitted line,
the largest size it predicts under a budget, where its extrapolation stops being trusted
(advise.SAFE_REACH) and the check of a prediction against the runs recorded after it. The
runs are written through the store (no training); every figure below is worked out by hand
or by numpy, not read back from advise."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from memstudy import advise
from memstudy.byte_sizes import parse_bytes
from memstudy.errors import ConfigError
from memstudy.store import ResultsDB
from test_report_decide import CONTEXT_MB, GPU, gpu_run

MB = 1024**2
GIB = 1024**3
SIZES = (512, 768, 1024)
# every run has a budget (8 GiB), so each measured its CUDA context (500 MB): a phase's
# absolute peak is 300 MB start + its increment + 500. gpu_run: backward's increment is half
# the forward's, the step's 50 MB.
# lin (recorded as amp; check reads set names as techniques): forward absolute = 1000 MB + 2000 MB per 1024**2 px, exactly; step 0.02 + 0.08 s per 1024**2 px
LIN_A, LIN_B = 1000, 2000
# bent (recorded as checkpoint): forward absolute 1200, 1500, 3200 MB: no line goes through it
BENT = (1200, 1500, 3200)
LIN, BENDS = "amp", "checkpoint"


def x(side: float) -> float:
    return side * side / 1024**2


@pytest.fixture
def db(tmp_path):
    db = ResultsDB(tmp_path / "three.sqlite")
    for side, bent in zip(SIZES, BENT):
        gpu_run(db, LIN, side, LIN_A + LIN_B * x(side) - 300 - CONTEXT_MB,
                0.02 + 0.08 * x(side), budget="8GiB")
        gpu_run(db, BENDS, side, bent - 300 - CONTEXT_MB, 0.3, budget="8GiB")
    return db


def predictions(db, budget: str, size) -> dict[str, advise.Prediction]:  # noqa: F811
    _device, preds, skipped = advise.predict_all(db, budget, size)
    assert skipped == []
    return {p.name: p for p in preds}


def test_the_line_through_three_sizes_is_the_least_squares_fit(db):  # noqa: F811
    lin, bent = predictions(db, "4GiB", 896).values()  # ranked: lin is faster
    assert (lin.name, bent.name) == (LIN, BENDS)
    a, b = lin.phase_fits["forward"]
    assert a / MB == pytest.approx(LIN_A) and b * 1024**2 / MB == pytest.approx(LIN_B)
    assert lin.measured_px == [s * s for s in SIZES] and lin.phase == "forward"
    assert lin.peak_bytes / MB == pytest.approx(LIN_A + LIN_B * x(896))  # 2531.25 MB
    assert lin.step_time_s == pytest.approx(0.02 + 0.08 * x(896))
    assert lin.fit_error == pytest.approx(0, abs=1e-9)  # three sizes: checked, and exact
    assert lin.confidence == "interpolated 768-1024 px" and lin.fits
    # bent: numpy's least squares over pixels, each phase; fit error the largest relative gap
    px = np.array([s * s for s in SIZES], dtype=float)
    phases = {"forward": np.array(BENT, dtype=float),
              "backward": 800 + (np.array(BENT) - 800) / 2, "step": np.full(3, 850.0)}
    fitted = {k: np.polyfit(px, y, 1) for k, y in phases.items()}
    slope, icept = fitted["forward"]
    assert bent.phase_fits["forward"][0] / MB == pytest.approx(icept)
    assert bent.phase_fits["forward"][1] / MB == pytest.approx(slope)
    gaps = [abs(np.polyval(fitted[k], px) - y) / y for k, y in phases.items()]
    assert bent.fit_error == pytest.approx(max(g.max() for g in gaps))
    assert bent.peak_bytes / MB == pytest.approx(np.polyval(fitted["forward"], 896**2))


def test_the_largest_size_under_a_budget_is_where_the_binding_line_meets_it(db):  # noqa: F811
    """Under 2 GiB at 1024 px (measured: 3000 MB) nothing fits; lin, the closest, is predicted
    to train a square of at most 741 px: where its forward line reaches 2048 MB (its backward
    line, 900 + 1000 MB per 1024**2 px, would allow 1097 px)."""
    preds = list(predictions(db, "2GiB", 1024).values())
    with pytest.raises(ConfigError) as exc:
        advise.refuse_if_none_fits(GPU,
                                   1024, "2GiB", preds)
    message = str(exc.value)
    assert f"the closest is {LIN}, predicted peak 3000 MB" in message
    assert "a budget of at least 3GiB, or a size of at most ~741 px (square)" in message
    side = int(1024 * ((2048 - LIN_A) / LIN_B) ** 0.5)
    assert side == 741 and LIN_A + LIN_B * x(side) <= 2048 < LIN_A + LIN_B * x(side + 1)


@pytest.mark.parametrize("size, confidence, trusted", [
    ("1024x2048", "extrapolated 2.0x the pixels of 1024 px", True),  # exactly SAFE_REACH
    ("1024x2049", "extrapolated 2.0x the pixels of 1024 px, beyond the 2x advise trusts", False),
    ("256x512", "extrapolated 0.5x the pixels of 512 px", True),  # below: half the pixels
    ("256x511", "extrapolated 0.5x the pixels of 512 px, beyond the 2x advise trusts", False),
    ("600x700", "interpolated 512-768 px", True),
])
def test_extrapolation_is_marked_beyond_safe_reach(db, size, confidence, trusted):  # noqa: F811
    lin = predictions(db, "64GiB", size)[LIN]
    assert lin.confidence == confidence and (lin.reach <= advise.SAFE_REACH) == trusted
    if trusted:
        advise.check_reach(lin, size)  # --confirm runs it
    else:
        with pytest.raises(ConfigError, match="--confirm --force"):
            advise.check_reach(lin, size)


def test_the_check_table_sets_each_prediction_beside_its_later_run(db):  # noqa: F811
    device, preds, _ = advise.predict_all(db, "4GiB", 896)
    advise.store(db.path, device, 896, "4GiB", 1, preds)
    time.sleep(0.01)
    gpu_run(db, LIN, 896, 2600 - 300 - CONTEXT_MB, 0.09, budget="4GiB")  # 2600 MB: ok
    gpu_run(db, BENDS, 896, 0, 0, budget="4GiB", status="oom")  # predicted to fit: wrong
    lin, bent = advise.check(db)
    assert (lin["name"], lin["status"], lin["fit_call"]) == (LIN, "ok", "right")
    assert lin["measured_mb"] == pytest.approx(2600)
    assert lin["peak_error"] == pytest.approx((LIN_A + LIN_B * x(896)) / 2600 - 1)  # -2.6%
    assert lin["step_error"] == pytest.approx((0.02 + 0.08 * x(896)) / 0.09 - 1)
    assert (bent["name"], bent["status"], bent["fit_call"]) == (BENDS, "oom", "wrong")
    assert bent["measured_mb"] is None and bent["peak_error"] is None
    header, rule, *lines = advise.check_table([lin, bent]).splitlines()
    assert header.split()[:3] == ["prediction", "techniques", "px"]
    assert lines[0].split()[:4] == ["1", LIN, "896", "4GiB"]
    assert "2531.25" in lines[0] and "-2.6%" in lines[0] and lines[0].endswith("right")
    assert lines[1].split()[:2] == ["2", BENDS] and lines[1].endswith("wrong")
    assert len(lines) == 2  # both keyed, nothing left out: no line under the table


def _run(status="oom", size=1024, budget="4GiB", phase="backward"):
    return {"status": status, "image_size": size, "failed_phase": phase,
            "config": {} if budget is None else {"budget": budget}}


@pytest.mark.parametrize("runs, size, budget, said", [
    # an oom at fewer pixels under a larger budget: the larger image under less cannot fit
    ([_run()], 2048, "2GiB", "recorded oom in backward at 1024 px under 4GiB"),
    ([_run()], 1024, "4GiB", "recorded oom in backward at 1024 px under 4GiB"),  # the same
    ([_run(phase="forward", size="1024x512")], "1024x512", "4GiB",
     "recorded oom in forward at 1024x512 px under 4GiB"),
    ([_run()], 1023, "4GiB", None),  # a smaller image may fit
    ([_run()], 1024, "5GiB", None),  # so may a larger budget
    ([_run(status="ok")], 2048, "2GiB", None),
    ([_run(budget=None)], 2048, "2GiB", None),  # no budget: an oom of the whole GPU says nothing
    ([_run(status="ok"), _run(size=512, phase="step")], 2048, "2GiB",
     "recorded oom in step at 512 px under 4GiB"),
])
def test_a_recorded_oom_overrules_the_fit(runs, size, budget, said):
    from memstudy.image_sizes import size_hw

    h, w = size_hw(size)
    assert advise._recorded_oom(runs, h * w, parse_bytes(budget)) == said


def test_no_measured_set_and_an_overruled_closest_are_refused_as_such():
    with pytest.raises(ConfigError) as exc:
        advise.refuse_if_none_fits(GPU, 1024, "2GiB", [])
    assert str(exc.value) == (f"no technique set on {GPU} was measured at two sizes; record "
                              "more runs (memstudy grid, memstudy maxres) before asking advise")
    overruled = advise.Prediction(name="a", peak_bytes=GIB, step_time_s=None, phase="forward",
                                  confidence="fitted", fit_error=None, fits=False,
                                  why_not="recorded oom in forward at 512 px under 4GiB",
                                  differs="train.batch_size=2")
    larger = advise.Prediction(name="b", peak_bytes=3 * GIB, step_time_s=None, phase="forward",
                               confidence="fitted", fit_error=None, fits=False)
    with pytest.raises(ConfigError) as exc:  # the set no run rules out is the closest
        advise.refuse_if_none_fits(GPU, 1024, "2GiB", [overruled, larger])
    assert str(exc.value) == (f"no technique set is predicted to fit 1024 px under 2GiB on {GPU}: "
                              "the closest is b, predicted peak 3072 MB; it would need a budget "
                              "of at least 3GiB")
    with pytest.raises(ConfigError) as exc:
        advise.refuse_if_none_fits(GPU, 1024, "2GiB", [overruled])
    assert str(exc.value) == (f"no technique set is predicted to fit 1024 px under 2GiB on {GPU}: "
                              "the closest is a (train.batch_size=2), predicted peak 1024 MB "
                              "(recorded oom in forward at 512 px under 4GiB); it would need "
                              "more than this budget, which a recorded run already exceeded")
    advise.refuse_if_none_fits(GPU, 1024, "2GiB", [overruled, dataclasses.replace(larger, fits=True)])


def test_a_measured_size_is_answered_by_its_runs_not_by_the_line(db):  # noqa: F811
    """At 768 px both sets were measured: the bent set's peak is its recorded 1500 MB (its
    line says otherwise), its step the recorded 0.3 s; a budget of exactly that peak fits."""
    bent = predictions(db, "4GiB", 768)[BENDS]
    a, b = bent.phase_fits[bent.phase]
    assert abs(a + b * 768**2 - 1500 * MB) > 50 * MB  # the line is off there
    assert bent.peak_bytes == 1500 * MB and bent.step_time_s == pytest.approx(0.3)
    assert bent.confidence.startswith("measured")
    assert predictions(db, f"{1500 * MB}B", 768)[BENDS].fits
    assert not predictions(db, f"{1500 * MB - 1}B", 768)[BENDS].fits
    lin = predictions(db, "4GiB", 768)[LIN]
    assert lin.step_time_s == pytest.approx(0.02 + 0.08 * x(768))


def test_a_recorded_oom_rules_a_set_out_whatever_its_line_says(db):  # noqa: F811
    """lin's line puts 768 px at 2125 MB, under 3 GiB; an oom recorded at 512 px under 3 GiB
    overrules it: not fitting, with the run named, ranked after the sets that fit."""
    assert predictions(db, "3GiB", 768)[LIN].fits
    gpu_run(db, LIN, 512, 0, 0, budget="3GiB", status="oom")
    lin = predictions(db, "3GiB", 768)[LIN]
    assert not lin.fits
    assert lin.why_not == "recorded oom in forward at 512 px under 3GiB"
    assert predictions(db, "4GiB", 768)[LIN].fits  # a larger budget than the oom's: the line


def test_a_bad_budget_or_size_is_named_by_its_flag(db):  # noqa: F811
    with pytest.raises(ValueError, match="^--budget 'lots' is not a byte size"):
        advise.predict_all(db, "lots", 512)
    with pytest.raises(ConfigError, match="^--size = 'huge' is not a size"):
        advise.predict_all(db, "4GiB", "huge")
    with pytest.raises(ConfigError) as exc:
        advise.predict_all(db, "4GiB", "native")
    assert str(exc.value) == "advise needs a size in pixels (4188 or 4188x3500), not 'native'"
    overruled = advise.Prediction("a", GIB, None, "forward", "fitted", None, False)
    for call in (lambda: advise.describe(GPU, 512, "lots", [overruled]),
                 lambda: advise.refuse_if_none_fits(GPU, 512, "lots", [overruled])):
        with pytest.raises(ValueError, match="^--budget 'lots'"):
            call()


def test_the_device_advise_reads_is_chosen_or_refused_by_name(monkeypatch):
    """--gpu picks by a case-insensitive part of the name; none or several matching, or
    several devices and none of them this machine's, is refused naming the devices."""
    runs = [{"gpu_name": name, "device": "cuda:0"} for name in ("NVIDIA H100 80GB HBM3",
                                                               "NVIDIA H200")]
    devices = ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    assert advise.choose_gpu(runs, "h100") == devices[0]
    cases = [("A100", f"--gpu 'A100': no runs on it in this database; choose one of {devices}"),
             ("nvidia", f"--gpu 'nvidia': several devices match it in this database; choose one "
                        f"of {devices}")]
    for wanted, said in cases:
        with pytest.raises(ConfigError) as exc:
            advise.choose_gpu(runs, wanted)
        assert str(exc.value) == said
    monkeypatch.setattr(advise, "current_gpu", lambda: devices[1])
    assert advise.choose_gpu(runs, None) == devices[1]  # this machine's, among several
    monkeypatch.setattr(advise, "current_gpu", lambda: None)
    assert advise.choose_gpu(runs[:1], None) == devices[0]  # the only one
    with pytest.raises(ConfigError) as exc:
        advise.choose_gpu(runs, None)
    assert str(exc.value) == (f"the database holds runs of several devices {devices}; choose "
                              "one with --gpu NAME")
    with pytest.raises(ConfigError) as exc:
        advise.choose_gpu([], None)
    assert str(exc.value) == ("the results database holds no runs; record some first "
                              "(memstudy grid, memstudy maxres) or pass another --db")


def test_a_run_name_reads_as_its_technique_specs():
    assert advise._specs("original") == [] and advise._specs("none") == []
    assert advise._specs("amp:bf16+checkpoint") == ["amp:bf16", "checkpoint"]
