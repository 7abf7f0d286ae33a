"""Model FLOPs: counted on the meta device, exact for a known convolution, linear in pixels."""
import torch
from torch.utils.flop_counter import FlopCounterMode

from memstudy.meters.flops import model_flops_per_step


def test_flop_counter_is_exact_for_a_convolution():
    conv = torch.nn.Conv2d(1, 8, 3, padding=1, bias=False).to("meta")
    with FlopCounterMode(display=False) as counter:
        conv(torch.empty(1, 1, 32, 32, device="meta"))
    assert counter.get_total_flops() == 2 * 32 * 32 * 8 * 9  # multiply-adds count twice


def test_model_flops_scale_with_pixels_and_batch():
    small = model_flops_per_step(1, 256)
    assert model_flops_per_step(1, 512) == 4 * small
    assert model_flops_per_step(2, 256) == 2 * small
    assert 40e9 < small < 50e9  # ResNet-34 U-Net: ~46 GFLOP per forward+backward at 256 px


def test_a_failing_flop_count_keeps_the_run(make_config, monkeypatch, tmp_path):
    """The FLOP count is derived after training: if it fails, the run is still recorded ok."""
    from memstudy import runner
    from memstudy.store import ResultsDB

    def broken(batch, size):
        raise RuntimeError("no meta kernel")

    monkeypatch.setattr(runner, "model_flops_per_step", broken)
    db = ResultsDB(tmp_path / "r.sqlite")
    rec = runner.execute(make_config(192, validate=False), db)
    assert rec.status == "ok" and "no meta kernel" in rec.env["model_flops_error"]
    (run,) = db.runs()
    figures = db.metrics(run["id"])[(0, "run")]
    assert "step_time_s" in figures and "model_tflops_s" not in figures
