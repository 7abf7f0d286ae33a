"""The network as configuration (memstudy/network.py, memstudy/models/): the encoder table
against smp's own, hashes of records written before [model] existed, and each bad network
setting refused in one line before anything is built."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from segmentation_models_pytorch.encoders.resnet import resnet_encoders

from memstudy import report
from memstudy.config import RunConfig, from_dict, set_value
from memstudy.errors import ConfigError
from memstudy.grid import config_hash, expand, load_spec
from memstudy.models import build_model
from memstudy.network import ENCODERS, ModelConfig
from memstudy.store import ResultsDB
from memstudy.techniques.compose import make_plan

ROOT = Path(__file__).resolve().parents[1]
# recorded on an H100 in 2026-11 by benchmarks/specs/paper-protocol.toml, before [model] existed
PAPER_DB = ROOT / "benchmarks/results/h100/paper/paper-protocol-512px.sqlite"
PAPER_SPEC = ROOT / "benchmarks/specs/paper-protocol.toml"


@pytest.fixture
def paper_db(tmp_path) -> ResultsDB:
    """A copy: opening a database may migrate it, and the committed file must stay as it was."""
    return ResultsDB(shutil.copy(PAPER_DB, tmp_path / PAPER_DB.name))


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_the_encoder_table_is_smps(name):
    params = resnet_encoders[name]["params"]
    ours = ENCODERS[name]
    assert params["block"].__name__ == {"basic": "BasicBlock", "bottleneck": "Bottleneck"}[ours.block]
    assert tuple(params["layers"]) == ours.layers
    assert params.get("groups", 1) == ours.groups
    assert tuple(params["out_channels"][1:]) == ours.out_channels[1:]


def test_every_resnet_family_encoder_smp_builds_is_in_the_table():
    assert set(resnet_encoders) == set(ENCODERS)


def test_records_written_before_the_network_section_keep_their_hashes(paper_db):
    runs = paper_db.runs()
    assert len(runs) == 36
    for run in runs:
        stored = json.loads(run["config_json"])
        assert "model" not in stored  # written before [model]
        assert from_dict(stored).hash() == run["config_hash"]


def test_a_grid_over_records_written_before_the_network_section_finds_every_cell_recorded(
        paper_db):
    """The spec's cells hash as their runs were recorded: a grid resumes with nothing to run
    (hashed here directly: its cells ask for a GPU, which the grid would check first)."""
    cells = expand(load_spec(PAPER_SPEC))
    recorded = {run["config_hash"] for run in paper_db.runs()}
    assert len(cells) == 36 and {config_hash(cell.config) for cell in cells} == recorded


def test_records_written_before_the_network_section_report(paper_db):
    text = report.build_report(paper_db)
    assert "amp" in text and "checkpoint" in text


def test_the_studys_network_hashes_as_before_and_another_does_not():
    study = RunConfig()
    assert study.hash() == RunConfig(model=ModelConfig(encoder="resnet34")).hash()
    others = [ModelConfig(encoder="resnet50"), ModelConfig(decoder_channels=[128, 64, 32, 16, 8])]
    assert len({study.hash(), *(RunConfig(model=m).hash() for m in others)}) == 3


@pytest.mark.parametrize("encoder", ["resnet18", "resnet50", "resnext50_32x4d"])
def test_the_configured_encoder_is_built(encoder):
    cfg = RunConfig(model=ModelConfig(encoder=encoder, decoder_channels=[64, 32, 16, 16, 8]))
    with torch.device("meta"):
        model = build_model(cfg, weights=False)
    assert model.encoder_name == encoder
    assert model.decoder_blocks[-1].conv2[0].out_channels == 8
    assert len(model.encoder.layer1) == ENCODERS[encoder].layers[0]


def _plan(**model) -> None:
    cfg = RunConfig(model=ModelConfig(**model))
    cfg.train.device, cfg.train.image_size, cfg.train.msssim_scales = "cpu", 64, 1
    make_plan(cfg)


@pytest.mark.parametrize("model, message", [
    ({"encoder": "resnet35"}, "model.encoder = 'resnet35' is not a ResNet-family encoder "
     "memstudy builds; use one of ['resnet101', "),
    ({"decoder_channels": [64, 32]}, "model.decoder_channels = [64, 32]: the U-Net has 5 decoder"),
    ({"classes": 3}, "model.classes = 3: enhancement predicts one grey image; set model.classes "
     "= 1, or train.task = 'segment'"),
    ({"in_channels": 3}, "model.in_channels = 3: memstudy's datasets give radiographs as one grey"),
    ({"factory": "no_colon"}, "model.factory = 'no_colon': write it as 'package.module:function'"),
    ({"factory": "no_such_package.net:make"}, "model.factory = 'no_such_package.net:make': cannot "
     "import 'no_such_package.net' (ModuleNotFoundError"),
    ({"factory": "user_networks.tiny:missing"}, "model.factory = 'user_networks.tiny:missing': "
     "user_networks.tiny has no function 'missing'"),
    ({"factory": "user_networks.tiny:not_a_module"}, "returned a str, not a torch.nn.Module"),
    ({"factory": "user_networks.tiny:wrong_shape"}, "returns (1, 1, 32, 32) for a (1, 1, 64, 64) "
     "input; memstudy needs N x model.classes x H x W = (1, 1, 64, 64)"),
    ({"factory": "user_networks.tiny:broken"}, "failed with model.kwargs = {}: RuntimeError: the "
     "user's code fails"),
    ({"factory": "user_networks.tiny:net", "kwargs": {"depth": 3}}, "failed with model.kwargs = "
     "{'depth': 3}: TypeError"),
    ({"factory": "user_networks.tiny:net", "encoder": "resnet50"}, "model.factory builds the whole "
     "network, so model.encoder and model.decoder_channels do not apply"),
])
def test_a_bad_network_is_one_line_before_anything_is_built(model, message):
    with pytest.raises(ConfigError) as err:
        _plan(**model)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_users_network_with_kwargs_plans():
    _plan(factory="user_networks.tiny:net", kwargs={"width": 4})


def test_the_network_is_set_from_the_command_line():
    cfg = RunConfig()
    set_value(cfg, "model.encoder=resnet50")
    set_value(cfg, "model.decoder_channels=[128, 64, 32, 16, 8]")
    assert cfg.model == ModelConfig(encoder="resnet50", decoder_channels=[128, 64, 32, 16, 8])
    with pytest.raises(ConfigError, match="model.classes must be an integer"):
        set_value(cfg, "model.classes=two")
