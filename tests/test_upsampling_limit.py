"""PyTorch's channels_last nearest up-sampling backward refuses gradients of INT_MAX elements
or more: the tuned amp:bf16 step failed in its first backward at 8192 x 8192 (H100,
2026-11-26, benchmarks/results/h100/tile-fast/native-8192-8gib-tuned.md). make_plan refuses
such a run before building anything and names what to change; tile's folded up-convolution
does not up-sample its levels, so a tiled run of the same size is accepted."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memstudy.errors import ConfigError
from memstudy.models import build_unet
from memstudy.models.unet import upsampled_elements
from memstudy.techniques.compose import make_plan

from conftest import small_config


def _plan(size, techniques, batch=1, channels_last=None):
    cfg = small_config(size, techniques, device="cuda", batch_size=batch)
    cfg.train.channels_last = channels_last
    return make_plan(cfg, device=torch.device("cuda"), n_gpus=1)


def test_upsampled_elements_are_those_the_decoder_makes(monkeypatch):
    made = []
    interpolate = F.interpolate

    def counted(x, *args, **kwargs):
        y = interpolate(x, *args, **kwargs)
        made.append(y.numel())
        return y

    monkeypatch.setattr(F, "interpolate", counted)
    with torch.no_grad():
        build_unet()(torch.rand(2, 1, 200, 130))  # padded to 224 x 160
    assert made and upsampled_elements(2, 200, 130) == max(made)
    assert upsampled_elements(2, 200, 130, folded_levels=2) == sorted(made)[-3]


def test_a_size_past_the_kernel_limit_is_refused_naming_tile():
    with pytest.raises(ConfigError, match="add tile") as refused:
        _plan(8192, ["amp:bf16", "checkpoint"])
    assert "2,147,483,648 elements" in str(refused.value)  # 32 x 8192 x 8192
    with pytest.raises(ConfigError, match="train.batch_size"):
        _plan(5888, ["amp:bf16"], batch=2)  # 2 x 32 x 5888^2: the batch counts too


def test_below_the_limit_tiled_or_contiguous_runs_are_planned():
    _plan(8160, ["amp:bf16"])  # 32 x 8160^2 < 2^31
    _plan(8192, ["amp:bf16", "checkpoint", "offload:which=boundaries", "tile:16:levels=3"])
    _plan(8192, ["amp:bf16"], channels_last=False)  # the NHWC kernel is not used


def test_the_ceiling_is_the_largest_square_the_check_accepts():
    from memstudy.techniques.compose import upsampling_ceiling

    untiled = _plan(256, ["amp:bf16"])
    assert upsampling_ceiling(untiled) == 8160  # 8161 pads to 8192: 32 x 8192^2 = 2^31
    _plan(8160, ["amp:bf16"])
    with pytest.raises(ConfigError):
        _plan(8161, ["amp:bf16"])
    assert upsampling_ceiling(_plan(256, ["amp:bf16"], batch=2)) < 8160
    tiled = _plan(256, ["checkpoint", "tile:4:levels=2"])  # block 2 (128 ch at 1/4) is next
    assert upsampling_ceiling(tiled) > 16000
    assert upsampling_ceiling(_plan(256, ["amp:bf16"], channels_last=False)) is None


def test_maxres_does_not_probe_past_the_ceiling(make_config, tmp_path, monkeypatch):
    """A set whose search would reach the kernel limit stops there and says so (on the CPU the
    limit does not apply: here it is set to 256 px)."""
    from memstudy import maxres as maxres_module

    monkeypatch.setattr(maxres_module, "kernel_ceiling", lambda template, techniques: 256)
    cfg = make_config(192, max_steps=2)
    cfg.budget = "8GiB"  # memory never binds at these sizes
    result = maxres_module.maxres(cfg, [], tmp_path / "r.sqlite", [192, 256], max_size=1024,
                                  isolate=False)
    assert result.error is None and result.found_px == 256 and result.ceiling == 256
    assert max(p.size for p in result.probes) == 256
    assert "channels_last up-sampling" in maxres_module._note(result)


def test_a_sharded_batch_counts_one_ranks_images():
    cfg = small_config(5888, ["amp:bf16", "dp"], device="cuda", batch_size=2, warmup_steps=2)
    cfg.world_size = 2
    make_plan(cfg, device=torch.device("cuda"), n_gpus=2)  # 1 image per rank: 32 x 5888^2
    with pytest.raises(ConfigError, match="train.batch_size"):
        _plan(5888, ["amp:bf16"], batch=2)  # the same batch in one process
