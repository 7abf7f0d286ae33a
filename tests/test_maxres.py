"""maxres: the a + b * pixels prediction, the 64 px search, and their agreement on the CPU."""
from __future__ import annotations

import pytest

from memstudy.errors import ConfigError
from memstudy.maxres import maxres_table, fit_line, maxres, predict_px, search, search_all, store_result
from memstudy.report import largest_size, memory_vs_resolution
from memstudy.store import ResultsDB

MIB = 1024**2


def test_fit_and_prediction_solve_the_line():
    a, b = 400e6, 1500.0  # bytes, bytes per pixel
    sizes = [192, 256, 320]
    fa, fb = fit_line(sizes, [a + b * s * s for s in sizes])
    assert fa == pytest.approx(a) and fb == pytest.approx(b)
    exact = ((2e9 - a) / b) ** 0.5  # 1032.8 px
    assert predict_px(fa, fb, int(2e9)) == int(exact) // 64 * 64 == 1024
    assert predict_px(fa, fb, int(a) - 1) is None  # not even the constant part fits
    with pytest.raises(ConfigError, match="two different fit sizes"):
        fit_line([256, 256], [1.0, 2.0])


@pytest.mark.parametrize("limit", [192, 256, 1000 // 64 * 64, 4096, 8192])
@pytest.mark.parametrize("start", [192, 640, 8192])
def test_search_finds_the_boundary_from_any_start(limit, start):
    probed = []

    def fits(size):
        probed.append(size)
        return size <= limit

    assert search(fits, start, 192, 8192) == limit
    assert all(s % 64 == 0 for s in probed) and len(set(probed)) == len(probed)
    assert len(probed) <= 2 * 7 + 2  # galloping then bisection: logarithmic in the distance


def test_search_when_nothing_fits():
    assert search(lambda s: False, 512, 192, 1024) is None


def test_prediction_and_search_agree_on_the_cpu(make_config, tmp_path):
    """Under a tensor-meter budget between the peaks at 256 and 320 px (~412 and ~436 MB of
    live tensors on the CPU), the prediction from 192 and 256 px and the search agree."""
    db = tmp_path / "r.sqlite"
    cfg = make_config(192, max_steps=2)
    cfg.budget = "424MiB"
    result = maxres(cfg, [], db, [192, 256], max_size=1024, isolate=False)
    assert result.error is None
    assert result.found_px == 256
    assert abs(result.predicted_px - result.found_px) <= 64
    # probes: the two fit sizes, then 320 (out of memory); 256 is read back, not rerun
    assert [(p.size, p.status) for p in result.probes] == [(192, "ok"), (256, "ok"), (256, "ok"),
                                                          (320, "oom")]
    assert len(ResultsDB(db).runs()) == 3
    store_result(db, cfg, result)
    store_result(db, cfg, result)  # a rerun replaces its row
    (row,) = largest_size(db)
    assert (row["found_px"], row["predicted_px"], row["budget"]) == (256, result.predicted_px, "424MiB")
    assert row["peak_mb"] < 424 and row["step_time_s"] > 0
    assert {r["image_size"] for r in memory_vs_resolution(db)} == {192, 256, 320}
    assert result.network == "resnet34 U-Net, enhance"  # the table names what was searched
    assert "resnet34 U-Net, enhance" in maxres_table([result])


@pytest.mark.parametrize("device, sets, named", [
    ("cpu", [["amp:bf16"], ["amp:bf16", "bogus"]], "unknown technique 'bogus'"),
    ("cpu", [["checkpoint:placement=everywhere"]], "placement"),
    ("cuda", [["amp:bf16"]], "train.device = 'cuda'"),  # this test runs where no GPU is visible
])
def test_bad_sets_refused_before_any_probe(make_config, tmp_path, monkeypatch, device, sets, named):
    """Every set is planned before the first probe: a probe's process would only have shown
    'left no record', and the sets before the bad one would have run for nothing."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = make_config(192, max_steps=2, device=device)
    cfg.budget = "424MiB"
    with pytest.raises(ConfigError, match=named):
        search_all(cfg, sets, tmp_path / "r.sqlite", [192, 256], isolate=False)
    assert not (tmp_path / "r.sqlite").exists()


def test_probes_measure_after_the_configs_warm_up(make_config):
    """With the default 3 warm-up steps a probe takes 5 steps, so 2 are measured (a probe of 3
    steps would have measured nothing and the fit would have had no phase peaks)."""
    from memstudy.maxres import prepare_template
    from memstudy.techniques import planned_steps
    from memstudy.train import check_measurable

    probe = prepare_template(make_config(192, warmup_steps=3))
    assert probe.train.max_steps == 5 and not probe.train.validate
    assert planned_steps(probe, probe.data.train_images) == 5
    check_measurable(probe, probe.data.train_images)
