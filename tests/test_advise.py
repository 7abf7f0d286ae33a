"""memstudy advise: predictions from recorded runs, ranked; refusals; checks; --confirm."""
from __future__ import annotations

import time

import pytest

from memstudy import advise
from memstudy.cli import main
from memstudy.store import ResultsDB
from test_report_decide import GPU, db, gpu_run  # noqa: F401 (db: the fixture database)

MB = 1024**2


def ranked(db, budget, size, **kw):  # noqa: F811
    _device, preds, skipped = advise.predict_all(db, budget, size, **kw)
    return preds, dict(skipped)


def test_ranks_the_fitting_sets_fastest_first(db):  # noqa: F811
    preds, skipped = ranked(db, "4GiB", 768)
    assert [p.name for p in preds] == ["amp", "checkpoint"] and all(p.fits for p in preds)
    amp = preds[0]
    # absolute forward peaks 1200 MB at 512 px and 2400 MB at 1024 px (context included):
    # linear in pixels, 768 px lies 5/12 of the way
    assert amp.peak_bytes / MB == pytest.approx(1200 + 1200 * (768**2 - 512**2) / (1024**2 - 512**2))
    assert amp.step_time_s == pytest.approx(0.06 + 0.14 * 5 / 12)
    assert amp.confidence == "interpolated 512-1024 px" and amp.phase == "forward"
    assert amp.val_loss_delta == pytest.approx(0.01) and amp.quality_at == 512
    assert "original" in skipped and "two" in skipped["original"]  # only 512 px finished


def test_a_tighter_budget_changes_the_ranking(db):  # noqa: F811
    preds, _ = ranked(db, "1.5GiB", 768)
    assert [(p.name, p.fits) for p in preds] == [("checkpoint", True), ("amp", False)]


def test_recorded_runs_overrule_the_line(db):  # noqa: F811
    preds, _ = ranked(db, "2GiB", 1024)
    ckpt = next(p for p in preds if p.name == "checkpoint")
    assert ckpt.confidence == "measured" and ckpt.peak_bytes == 1600 * MB
    far = next(p for p in ranked(db, "8GiB", 2048)[0] if p.name == "amp")
    assert far.confidence == "extrapolated 4.0x the pixels of 1024 px, beyond the 2x advise trusts"
    assert far.reach == 4.0 and ranked(db, "8GiB", 1400)[0][0].reach < advise.SAFE_REACH


def test_an_impossible_budget_is_refused_naming_the_closest(db, capsys):  # noqa: F811
    assert main(["--db", str(db.path), "advise", "--budget", "1GiB", "--size", "2048x1024"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memstudy: error: no technique set is predicted to fit 2048x1024 px")
    assert "closest is checkpoint" in err and "a budget of at least" in err and "px (square)" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "H100"], "--gpu 'H100': no runs on it"),
    (["--size", "native"], "not 'native'"),
    (["--budget", "lots"], "not a byte size"),
    (["--batch-size", "4"], "no single-device runs at batch size 4"),
])
def test_bad_input_is_one_line(db, capsys, argv, message):  # noqa: F811
    args = {"--budget": "4GiB", "--size": "768"}
    for flag, value in zip(argv[::2], argv[1::2]):
        args[flag] = value
    flat = [x for kv in args.items() for x in kv]
    assert main(["--db", str(db.path), "advise", *flat]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_several_gpus_need_a_choice(db, capsys):  # noqa: F811
    db.record  # noqa: B018
    from memstudy.store import RunRecord
    db.record(RunRecord(config={"train": {"image_size": 512, "batch_size": 1}, "world_size": 1},
                        config_hash="other", name="original", status="ok",
                        env={"device": "cuda:0", "gpu_name": "Other GPU"}, started_at=0.0))
    assert main(["--db", str(db.path), "advise", "--budget", "4GiB", "--size", "768"]) == 2
    assert "several devices" in capsys.readouterr().err
    assert main(["--db", str(db.path), "advise", "--budget", "4GiB", "--size", "768",
                 "--gpu", "test gpu"]) == 0


def test_predictions_are_stored_and_checked_against_later_runs(db, capsys):  # noqa: F811
    assert main(["--db", str(db.path), "advise", "--budget", "4GiB", "--size", "768"]) == 0
    assert "1  " in capsys.readouterr().out
    assert advise.check(db) == []  # nothing measured after it yet
    time.sleep(0.01)
    gpu_run(db, "amp", 768, 1500, 0.10, budget="4GiB")  # measured: 300 + 1500 + 500 = 2300 MB
    (row,) = advise.check(db)
    assert row["name"] == "amp" and row["measured_mb"] == pytest.approx(2300)
    assert row["peak_error"] == pytest.approx(1700 / 2300 - 1)
    assert row["fit_call"] == "right"
    assert main(["--db", str(db.path), "advise", "--check"]) == 0
    assert "-26.1%" in capsys.readouterr().out


@pytest.mark.slow
def test_confirm_runs_the_top_candidate_and_records_it(tmp_path, make_config, capsys):
    """The fit comes from two recorded CPU runs (tensor-meter figures written through the
    store, their configs real); --confirm then trains the third size for real."""
    from test_advise_confirm import cpu_db

    db = cpu_db(tmp_path, make_config)
    assert main(["--db", str(db.path), "advise", "--budget", "4GiB", "--size", "224",
                 "--confirm"]) == 0
    out = capsys.readouterr().out
    assert "confirmed original: ok" in out and "interpolated 192-256 px" in out
    (confirmed,) = [r for r in db.runs() if r["label"] == advise.CONFIRM_LABEL]
    assert confirmed["image_size"] == 224 and confirmed["status"] == "ok"
    (row,) = advise.check(db)
    assert row["run"] == confirmed["id"] and row["measured_mb"] > 0 and row["fit_call"] == "right"


def test_a_recorded_out_of_memory_run_overrules_a_fitting_line(db):  # noqa: F811
    gpu_run(db, "amp", 896, 0, 0, budget="4GiB", status="oom")
    amp = next(p for p in ranked(db, "4GiB", 960)[0] if p.name == "amp")
    assert amp.peak_bytes < 4096 * MB and not amp.fits
    assert amp.why_not == "recorded oom in forward at 896 px under 4GiB"
    assert next(p for p in ranked(db, "4GiB", 768)[0] if p.name == "amp").fits  # fewer pixels
    assert next(p for p in ranked(db, "8GiB", 960)[0] if p.name == "amp").fits  # larger budget


def _pinned_predictions():
    fits_with_quality = advise.Prediction(
        name="amp:bf16", peak_bytes=3.5 * 2**30, step_time_s=0.25, phase="backward",
        confidence="measured", fit_error=0.012, fits=True, val_loss_delta=0.00123,
        quality_at=1024, quality_under="amp:bf16 at 2 epochs", differs="train.batch_size=2")
    overruled = advise.Prediction(
        name="original", peak_bytes=9 * 2**30, step_time_s=None, phase="forward",
        confidence="extrapolated", fit_error=None, fits=False,
        why_not="oom recorded at 4096 px")
    fastest = advise.Prediction(name="checkpoint", peak_bytes=2 * 2**30, step_time_s=0.5,
                                phase="step", confidence="fitted", fit_error=0.2, fits=True,
                                val_loss_delta=-0.5)
    return fastest, fits_with_quality, overruled


def test_the_advice_reads_as_pinned():
    """advise's answer, word for word: the head (what a peak holds on each device), rank only
    for sets that fit, the budget's share, the quality delta with where it was measured, the
    overruling run, and the 'settings that differ' column only when a set differs."""
    fastest, fits_with_quality, overruled = _pinned_predictions()
    answer = advise.describe("NVIDIA H100", 4096, "4GiB", [fastest, fits_with_quality, overruled])
    assert answer == "\n".join([
        '4096 px under 4GiB on NVIDIA H100: 2 of 3 technique sets predicted to fit (fastest first; peaks: allocator bytes plus the CUDA context)',
        'rank  techniques  peak MB  of budget  step s                                        val loss - original    confidence  fit error  binding phase                         fits  settings that differ',
        '----  ----------  -------  ---------  ------  ---------------------------------------------------------  ------------  ---------  -------------  ---------------------------  --------------------',
        '1     checkpoint     2048        50%    0.50                                                    -0.5000        fitted        20%           step                          yes                     -',
        '2       amp:bf16     3584        88%    0.25  +0.0012 (at 1024 px, from runs with amp:bf16 at 2 epochs)      measured         1%       backward                          yes    train.batch_size=2',
        '-       original     9216       225%       -                                                          -  extrapolated          -        forward  no: oom recorded at 4096 px                     -',])
    assert advise.describe("cpu", 512, "1GiB", [fastest]) == "\n".join([
        '512 px under 1GiB on cpu: 1 of 1 technique sets predicted to fit (fastest first; peaks: live tensor bytes, parameters and optimizer state included)',
        'rank  techniques  peak MB  of budget  step s  val loss - original  confidence  fit error  binding phase  fits',
        '----  ----------  -------  ---------  ------  -------------------  ----------  ---------  -------------  ----',
        '1     checkpoint     2048       200%    0.50              -0.5000      fitted        20%           step   yes',])


def test_the_check_reads_as_pinned():
    """advise --check's table and its notes: signed errors, '-' where none, the predictions
    whose later runs were another experiment, and those stored without a key (one or many)."""
    row = dict(prediction=3, name="amp:bf16", size=2048, budget="4GiB", confidence="fitted",
               run=7, status="ok", predicted_mb=3000, measured_mb=3100, peak_error=-0.0323,
               predicted_s=0.2, measured_s=0.25, step_error=0.25, fit_call="right",
               not_used=[], keyed=True)
    other = dict(row, prediction=4, peak_error=None, step_error=None, keyed=False,
                 not_used=["run 9: train.batch_size=2", "run 10: seed 1"])
    assert advise.check_table([row, other]) == "\n".join([
        'prediction  techniques    px  budget  confidence  run  status  predicted MB  measured MB  peak error  predicted s  measured s  step error  fit call',
        '----------  ----------  ----  ------  ----------  ---  ------  ------------  -----------  ----------  -----------  ----------  ----------  --------',
        '3             amp:bf16  2048    4GiB      fitted    7      ok          3000         3100       -3.2%         0.20        0.25      +25.0%     right',
        '4             amp:bf16  2048    4GiB      fitted    7      ok          3000         3100           -         0.20        0.25           -     right',
        'prediction 4 (amp:bf16 at 2048 px): not used, another experiment: run 9: train.batch_size=2; run 10: seed 1',
        'prediction 4 (no experiment key: recorded before advise stored one): checked against runs of its techniques, size, batch and GPU, whatever their other settings',])
    many = advise.check_table([row, other, dict(row, prediction=5, keyed=False)])
    assert many.split("\n")[-1] == (
        'predictions 4, 5 (no experiment key: recorded before advise stored one): checked against runs of its techniques, size, batch and GPU, whatever their other settings')
