"""allocator: caching-allocator settings validated by name, applied once per process before
CUDA initialises, refused where they could no longer take effect."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import small_config
from memstudy import cuda_allocator
from memstudy.errors import ConfigError
from memstudy.runner import _read_back_allocator
from memstudy.store import RunRecord
from memstudy.techniques.compose import make_plan, prepare_process

CUDA = torch.device("cuda")


def cuda_plan(techniques: list[str]):
    """A plan for a one-GPU host (validation only: nothing is built)."""
    cfg = small_config(techniques=techniques)
    cfg.train.device = "cuda"
    return make_plan(cfg, device=CUDA, n_gpus=1)


@pytest.fixture
def fresh_process(monkeypatch):
    """This process as if nothing had configured its allocator, with the setter recorded."""
    calls: list[str] = []
    monkeypatch.setattr(cuda_allocator, "_applied", None)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append)
    for var in cuda_allocator.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return calls


@pytest.mark.parametrize("spec, fragment", [
    ("allocator:roundup=4", "technique allocator has no option 'roundup'"),
    ("allocator:garbage_collection_threshold=1.5", "garbage_collection_threshold=1.5 must be within 0..1"),
    ("allocator:garbage_collection_threshold=-0.2", "garbage_collection_threshold=-0.2 must be within"),
    ("allocator:max_split_size_mb=10", "max_split_size_mb=10 must be >= 20"),
    ("allocator:expandable_segments=maybe", "expandable_segments='maybe' is not a valid bool"),
    ("allocator", "every option at its default changes nothing"),
])
def test_bad_options_are_refused_by_name(spec, fragment, fresh_process):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        cuda_plan([spec])
    assert fresh_process == []


def test_refused_on_the_cpu():
    with pytest.raises(ConfigError, match="allocator configures PyTorch's CUDA caching allocator"):
        make_plan(small_config(techniques=["allocator:expandable_segments=true"]))


@pytest.mark.parametrize("var", cuda_allocator.ENV_VARS)
def test_an_environment_setting_is_refused(fresh_process, monkeypatch, var):
    monkeypatch.setenv(var, "expandable_segments:True")
    with pytest.raises(ConfigError, match=f"{var}='expandable_segments:True' is set"):
        cuda_plan(["allocator:max_split_size_mb=256"])


def test_settings_are_applied_once_before_cuda(fresh_process):
    spec = "allocator:expandable_segments=true:garbage_collection_threshold=0.7:max_split_size_mb=512"
    prepare_process(cuda_plan([spec, "amp:bf16"]))
    assert fresh_process == ["expandable_segments:True,garbage_collection_threshold:0.7,"
                             "max_split_size_mb:512"]
    prepare_process(cuda_plan([spec]))  # the same settings again (a distributed rank): no-op
    assert len(fresh_process) == 1
    with pytest.raises(ConfigError, match="cannot be reconfigured"):
        prepare_process(cuda_plan(["allocator:expandable_segments=true"]))
    prepare_process(cuda_plan(["amp:bf16"]))  # no allocator: nothing to apply
    assert len(fresh_process) == 1


def test_refused_once_cuda_is_initialised(fresh_process, monkeypatch):
    plan = cuda_plan(["allocator:expandable_segments=true"])  # planning alone never refuses
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # simulated
    with pytest.raises(ConfigError, match="CUDA is already initialised in this process"):
        prepare_process(plan)
    assert fresh_process == []


def test_pytorch_refusal_is_a_config_error(fresh_process, monkeypatch):
    def refuse(text):
        raise ValueError("Unrecognized key")

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse)
    with pytest.raises(ConfigError, match="allocator: PyTorch refused 'expandable_segments:True'"):
        prepare_process(cuda_plan(["allocator:expandable_segments=true"]))


def test_pytorch_accepts_the_settings_string(tmp_path):
    """The real setter, in a fresh process (it changes process-global state)."""
    code = (
        "import torch, sys; sys.path.insert(0, 'tests')\n"
        "from test_tech_allocator import cuda_plan\n"
        "from memstudy.techniques.compose import prepare_process\n"
        "prepare_process(cuda_plan(['allocator:expandable_segments=true:"
        "garbage_collection_threshold=0.6:max_split_size_mb=256']))\n"
        "print(torch._C._accelerator_getAllocatorSettings())\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=root)
    assert out.stdout.strip().splitlines()[-1] == ("expandable_segments:True,"
                                                   "garbage_collection_threshold:0.6,max_split_size_mb:256")


def test_the_record_names_the_settings_and_their_source(fresh_process, monkeypatch):
    """What the allocator was configured with: memstudy's own settings (whatever torch's getter
    says), else the environment's, else PyTorch's defaults."""
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    assert cuda_allocator.describe() == {"allocator_settings": "",
                                         "allocator_settings_source": "defaults"}
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert cuda_allocator.describe() == {"allocator_settings": "max_split_size_mb:128",
                                         "allocator_settings_source": "environment"}
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    prepare_process(cuda_plan(["allocator:expandable_segments=true:max_split_size_mb=64"]))
    assert cuda_allocator.describe() == {
        "allocator_settings": "expandable_segments:True,max_split_size_mb:64",
        "allocator_settings_source": "allocator technique"}


def fake_allocator(monkeypatch, values: dict | None) -> None:
    """torch's CUDA allocator as its memory snapshot reports it (no GPU needed)."""
    snapshot = {"segments": [], "device_traces": []}
    if values is not None:
        snapshot["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": "", **values}
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda device=None: snapshot)
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "native")


UNLIMITED = -1  # SIZE_MAX as the snapshot's int64


@pytest.mark.parametrize("values, verified, mismatch", [
    ({"expandable_segments": True, "max_split_size": 64 << 20,
      "garbage_collection_threshold": 0.0}, True, None),
    ({"expandable_segments": False, "max_split_size": UNLIMITED,
      "garbage_collection_threshold": 0.0}, False,
     ["expandable_segments: True asked, False reported", "max_split_size_mb: 64 asked, 0 reported"]),
    (None, None, None),  # a torch whose snapshot reports no settings: nothing claimed
])
def test_the_allocator_is_read_back_and_compared(monkeypatch, capsys, values, verified, mismatch):
    fake_allocator(monkeypatch, values)
    record = RunRecord(config={}, config_hash="", name="x", status="ok", started_at=0.0,
                       env={"allocator_settings": "expandable_segments:True,max_split_size_mb:64"})
    _read_back_allocator(record, CUDA)
    assert record.env["allocator_reported"]["backend"] == "native"
    assert record.env.get("allocator_verified") is verified
    assert record.env.get("allocator_mismatch") == mismatch
    assert ("reports other settings" in capsys.readouterr().err) == (verified is False)


def test_defaults_are_verified_against_an_empty_string(monkeypatch):
    fake_allocator(monkeypatch, {"expandable_segments": False, "max_split_size": UNLIMITED,
                                 "garbage_collection_threshold": 0.0})
    facts = cuda_allocator.read_back("", CUDA)
    assert facts["allocator_verified"] is True
    assert facts["allocator_reported"]["max_split_size_mb"] == 0


def test_a_failing_read_back_keeps_the_record(monkeypatch):
    def broken(device=None):
        raise RuntimeError("snapshot unavailable")
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", broken)
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "native")
    record = RunRecord(config={}, config_hash="", name="x", status="ok", started_at=0.0,
                       env={"allocator_settings": ""})
    _read_back_allocator(record, CUDA)
    assert record.status == "ok" and "snapshot unavailable" in record.env["allocator_read_back_error"]


@pytest.mark.gpu
@pytest.mark.slow
def test_a_cuda_run_applies_and_records_the_settings(tmp_path):
    db = tmp_path / "a.sqlite"
    cmd = [sys.executable, "-m", "memstudy", "--db", str(db), "run", "--device", "cuda",
           "--size", "512", "--steps", "5", "-t", "allocator:expandable_segments=true",
           "--set", "data.train_images=5", "--set", "train.validate=false"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    from memstudy.store import ResultsDB

    run = ResultsDB(db).runs()[-1]
    env = json.loads(run["env_json"])
    assert env["allocator_settings"] == "expandable_segments:True"
    assert env["allocator_settings_source"] == "allocator technique"
    assert env["allocator_reported"]["expandable_segments"] is True, env
    assert env["allocator_verified"] is True, env
    rows = ResultsDB(db).query("SELECT name, value FROM metrics WHERE phase = 'run'")
    figures = {r["name"]: r["value"] for r in rows}
    assert figures["fragmentation_bytes"] == (figures["reserved_peak_total_bytes"]
                                              - figures["alloc_peak_total_bytes"])


@pytest.mark.gpu
@pytest.mark.slow
def test_checks_leave_cuda_unstarted_for_the_allocator():
    """On a GPU, in a fresh process: planning (every technique's check) must not start CUDA,
    or the allocator technique refuses the run (compile's Triton check did, via has_triton()
    and then current_device()). Both sets are planned in one process: a check that starts
    CUDA in the first is caught before the second plans."""
    sets = [["amp:bf16", "compile:memory_budget=0.5", "allocator:expandable_segments=true"],
            ["amp:tf32", "checkpoint", "offload", "allocator:expandable_segments=true"]]
    code = (
        "import torch\n"
        "from memstudy.config import RunConfig\n"
        "from memstudy.techniques.compose import make_plan, prepare_process\n"
        f"for techniques in {sets!r}:\n"
        "    cfg = RunConfig(techniques=techniques)\n"
        "    cfg.train.device, cfg.meter.tensor = 'cuda', 'off'\n"
        "    plan = make_plan(cfg)\n"
        "    assert not torch.cuda.is_initialized(), f'a check of {techniques} started CUDA'\n"
        "    prepare_process(plan)\n"
        "print('prepared')\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0 and out.stdout.strip() == "prepared", out.stderr
