"""Memory budget: over the budget a run fails as 'oom' in its phase; without it, it fits."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import memstudy.budget as budget_mod
from memstudy.budget import (allocator_fraction, apply_budget, budget_bytes, check_floor,
                             cuda_context_bytes, nvml_used, recap_after_warmup)
from memstudy.byte_sizes import size_text
from memstudy.cli import main
from memstudy.errors import ConfigError
from memstudy.runner import execute
from memstudy.store import ResultsDB

GIB, MIB = 1024**3, 1024**2
# A 192 px CPU run of the ResNet-34 U-Net holds ~390 MB of live tensors at its peak
# (parameters, gradients, Adam state, activations); 300 MiB cannot hold it.
TOO_SMALL = "300MiB"
RUN = ["run", "--size", "192", "--steps", "1", "--device", "cpu", "--set", "data.train_images=1",
       "--set", "data.val_images=1", "--set", "train.validate=false", "--set",
       "train.warmup_steps=0", "--set", "train.measure_steps=1", "-q"]


def test_budget_bytes_and_allocator_fraction():
    assert budget_bytes("8GiB") == 8 * GIB and budget_bytes(None) is None
    with pytest.raises(ConfigError, match="byte size"):
        budget_bytes("eight")
    # an 80 GiB card emulating 8 GiB with a 500 MiB context: the allocator gets 7.5 GiB
    assert allocator_fraction(8 * GIB, 500 * MIB, 80 * GIB) * 80 * GIB == pytest.approx(8 * GIB - 500 * MIB)
    assert allocator_fraction(80 * GIB, 500 * MIB, 80 * GIB) == (80 * GIB - 500 * MIB) / (80 * GIB)
    with pytest.raises(ConfigError) as info:
        allocator_fraction(80 * GIB + 1, 500 * MIB, 80 * GIB)
    assert str(info.value) == ("budget 80GiB exceeds the GPU's 81920 MB; lower budget or drop it")
    with pytest.raises(ConfigError) as info:  # the context alone fills it: nothing is left
        allocator_fraction(500 * MIB, 500 * MIB, 80 * GIB)
    assert str(info.value) == ("budget 500MiB does not even hold the CUDA context (500 MB "
                               "measured by NVML); raise budget")


def test_a_floor_names_what_the_budget_cannot_hold():
    """check_floor: a budget must exceed the context plus the parameters (equal leaves nothing
    for activations); the line names the parts there are."""
    check_floor(699 * MIB, 698 * MIB, 0, "measured by NVML")  # one byte over: accepted
    for limit, context, params, held, above in [
        (698 * MIB, 698 * MIB, 0, "the CUDA context (698 MB, measured by NVML)", "698MiB"),
        (100 * MIB, 0, 100 * MIB, "the model's parameters (100 MB)", "100MiB"),
        (0, 0, 0, "anything", "0MiB"),
    ]:
        with pytest.raises(ConfigError) as info:
            check_floor(limit, context, params, "measured by NVML")
        assert str(info.value) == (f"budget {size_text(limit)} cannot hold {held}, before any "
                                   f"activation; raise --budget above {above}")


@pytest.fixture
def mock_cuda(monkeypatch):
    """A CUDA device stood in for on the CPU (80 GiB, 'Mock GPU'): NVML's used bytes are read
    from `nvml` in order, the allocator reserves `reserved`, `torch.cuda.init` creates the
    context, the caps set go to `caps`, and the device index every call names goes to `asked`
    (None where a call names none)."""
    import memstudy.budget as budget_mod

    cuda = SimpleNamespace(initialized=False, current=0, reserved=2 * MIB, nvml=[], asked=[],
                           caps=[], emptied=0)

    def ask(device) -> None:
        cuda.asked.append(device.index if isinstance(device, torch.device) else device)

    real_empty = torch.empty  # the tensor that creates the context: made on the CPU

    def empty(*size, device=None, **kw):
        ask(torch.device(device))
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda.initialized)
    monkeypatch.setattr(torch.cuda, "init", lambda: setattr(cuda, "initialized", True))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cuda.current)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: ask(device))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: ask(device) or cuda.reserved)
    monkeypatch.setattr(torch.cuda, "empty_cache",
                        lambda: setattr(cuda, "emptied", cuda.emptied + 1))
    monkeypatch.setattr(budget_mod, "nvml_used", lambda index: ask(index) or cuda.nvml.pop(0))
    monkeypatch.setattr(torch, "empty", empty)
    def properties(device=None):  # like torch's, initialises its CUDA (_lazy_init)
        ask(device)
        cuda.initialized = True
        return SimpleNamespace(total_memory=80 * GIB, name="Mock GPU")

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(budget_mod, "_BEFORE_CONTEXT", {})  # a fresh process
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, i: cuda.caps.append((f, i)))
    return cuda


def test_apply_budget_caps_the_allocator_at_budget_minus_the_context(mock_cuda):
    """Before the context exists, it is NVML used after creating it minus before (read before
    torch reads the device's properties, which starts its CUDA), minus what the allocator
    reserved; the allocator's cap leaves it out of the budget."""
    mock_cuda.nvml = [3 * GIB, 3 * GIB + 700 * MIB]  # before, after the context is created
    facts = apply_budget(4 * GIB, torch.device("cuda", 1), parameter_bytes=100 * MIB)
    context = 698 * MIB
    fraction = (4 * GIB - context) / (80 * GIB)
    assert facts == {"budget_bytes": 4 * GIB, "budget_enforced_by": "allocator cap",
                     "cuda_context_bytes": context, "allocator_cap_bytes": 4 * GIB - context,
                     "memory_fraction": fraction, "nvml_baseline_bytes": 3 * GIB}
    assert mock_cuda.caps == [(fraction, 1)] and set(mock_cuda.asked) == {1}
    assert mock_cuda.initialized and mock_cuda.nvml == []  # NVML read before and after


def test_a_device_without_an_index_is_device_0_before_the_context_exists(mock_cuda):
    """Asking torch for the current device would create the context before it is measured."""
    mock_cuda.current, mock_cuda.nvml = 2, [3 * GIB, 3 * GIB + 700 * MIB]
    facts = apply_budget(4 * GIB, torch.device("cuda"))
    assert facts["cuda_context_bytes"] == 698 * MIB and set(mock_cuda.asked) == {0}
    assert mock_cuda.caps == [((4 * GIB - 698 * MIB) / (80 * GIB), 0)]
    mock_cuda.initialized, mock_cuda.asked = False, []
    budget_mod._BEFORE_CONTEXT.clear()  # another process
    mock_cuda.nvml = [GIB, GIB + 10 * MIB]
    assert cuda_context_bytes(torch.device("cuda")) == 8 * MIB and set(mock_cuda.asked) == {0}


def test_nvml_used_reads_the_device_it_is_given(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda device: asked.append(device) or 5)
    assert nvml_used(3) == 5 and asked == [torch.device("cuda", 3)]


def test_once_the_context_exists_it_is_nvml_used_minus_reserved(mock_cuda):
    """An earlier run in this process made the context: NVML used minus the allocator's
    reserved bytes, on the current device when the run names none."""
    mock_cuda.initialized, mock_cuda.current = True, 2
    mock_cuda.nvml, mock_cuda.reserved = [2 * GIB], 512 * MIB
    facts = apply_budget(8 * GIB, torch.device("cuda"))
    assert facts["cuda_context_bytes"] == 1536 * MIB
    assert mock_cuda.caps == [((8 * GIB - 1536 * MIB) / (80 * GIB), 2)]
    assert facts["allocator_cap_bytes"] == 8 * GIB - 1536 * MIB
    assert mock_cuda.asked and set(mock_cuda.asked) == {2}


def test_no_budget_lifts_an_earlier_cap_without_creating_the_context(mock_cuda):
    """...and reads NVML's baseline, so an unbudgeted run's device peak is its own too."""
    mock_cuda.nvml = [616 * MIB]
    assert apply_budget(None, torch.device("cuda", 0)) == {"nvml_baseline_bytes": 616 * MIB}
    assert mock_cuda.caps == [] and not mock_cuda.initialized  # no context to cap yet
    mock_cuda.initialized, mock_cuda.asked = True, []
    assert apply_budget(None, torch.device("cuda", 3)) == {"nvml_baseline_bytes": 0}
    assert mock_cuda.caps == [(1.0, 3)] and mock_cuda.asked == []


def fresh_process(cuda, nvml: list[int]) -> None:
    cuda.initialized, cuda.caps, cuda.nvml = False, [], nvml
    budget_mod._BEFORE_CONTEXT.clear()


def test_a_budget_the_device_cannot_give_is_refused_before_any_cap(mock_cuda):
    mock_cuda.nvml = [3 * GIB]
    with pytest.raises(ConfigError) as info:
        apply_budget(81 * GIB, torch.device("cuda", 0))
    assert str(info.value) == ("budget 81GiB exceeds the 81920 MB of the Mock GPU; lower "
                               "--budget to at most 81920MiB or drop it")
    assert mock_cuda.asked == [0, 0] and mock_cuda.nvml == []  # the baseline, the capacity
    fresh_process(mock_cuda, [3 * GIB, 3 * GIB + 700 * MIB])
    facts = apply_budget(80 * GIB, torch.device("cuda", 0))  # all of it: accepted
    assert facts["allocator_cap_bytes"] == 80 * GIB - 698 * MIB and mock_cuda.caps
    fresh_process(mock_cuda, [3 * GIB, 3 * GIB + 700 * MIB])
    with pytest.raises(ConfigError) as info:
        apply_budget(750 * MIB, torch.device("cuda", 0), parameter_bytes=100 * MIB)
    assert str(info.value) == (
        "budget 750MiB cannot hold the CUDA context (698 MB, measured by NVML) plus the model's "
        "parameters (100 MB), before any activation; raise --budget above 798MiB")
    fresh_process(mock_cuda, [3 * GIB, 3 * GIB + 700 * MIB])
    with pytest.raises(ConfigError, match="raise --budget above 798MiB"):  # equal: nothing left
        apply_budget(798 * MIB, torch.device("cuda", 0), parameter_bytes=100 * MIB)
    assert mock_cuda.caps == []


def test_cpu_budget_is_left_to_the_tensor_meter():
    assert apply_budget(None, torch.device("cpu")) == {}
    assert apply_budget(GIB, torch.device("cpu")) == {"budget_bytes": GIB,
                                                          "budget_enforced_by": "tensor meter"}
    assert apply_budget(1, torch.device("cpu"))["budget_bytes"] == 1  # no parameters given
    with pytest.raises(ConfigError) as info:
        apply_budget(100 * MIB, torch.device("cpu"), parameter_bytes=100 * MIB)
    assert str(info.value) == ("budget 100MiB cannot hold the model's parameters (100 MB), "
                               "before any activation; raise --budget above 100MiB")


def test_a_cuda_budget_without_warm_up_is_refused_before_any_work(make_config):
    """The cap that holds a budget at device level is set after warm-up (recap_after_warmup);
    with no warm-up step the measured step would run under the first cap, which leaves the
    context's growth out: refused in make_plan, naming the setting. The CPU's tensor meter
    holds a budget from the first step."""
    from memstudy.techniques.compose import make_plan

    cfg = make_config(64, techniques=["amp:bf16"], warmup_steps=0, msssim_scales=1)
    cfg.budget = "8GiB"
    with pytest.raises(ConfigError) as info:
        make_plan(cfg, device=torch.device("cuda"), n_gpus=1)
    assert str(info.value) == ("budget 8GiB on CUDA needs train.warmup_steps >= 1: the "
                               "allocator's cap is set by the CUDA context as it is after "
                               "warm-up; set train.warmup_steps = 1 or more, or leave the "
                               "budget out")
    make_plan(cfg, device=torch.device("cpu"), n_gpus=0)
    cfg.train.warmup_steps = 1
    make_plan(cfg, device=torch.device("cuda"), n_gpus=1)
    cfg.train.warmup_steps, cfg.budget = 0, None
    make_plan(cfg, device=torch.device("cuda"), n_gpus=1)


def test_over_budget_fails_under_budget_and_fits_without(tmp_path):
    db = tmp_path / "r.sqlite"
    assert main(["--db", str(db), *RUN, "--budget", TOO_SMALL]) == 1
    assert main(["--db", str(db), *RUN]) == 0
    over, free = ResultsDB(db).runs()
    assert over["status"] == "oom" and over["failed_phase"] in ("forward", "backward", "step")
    assert "exceed the budget" in over["error"]
    assert free["status"] == "ok" and free["failed_phase"] is None


def test_oom_is_recorded_with_its_phase(make_config, tmp_path):
    """Forward at 192 px peaks at parameters + activations (~140 MB before Adam state
    exists); backward adds the gradients. A budget between the two fails in backward."""
    db = ResultsDB(tmp_path / "r.sqlite")
    cfg = make_config(192, validate=False, warmup_steps=0, max_steps=1)
    cfg.budget = "160MiB"
    rec = execute(cfg, db)
    assert (rec.status, rec.failed_phase) == ("oom", "backward")
    (row,) = db.runs()
    assert (row["status"], row["failed_phase"]) == ("oom", "backward")
    assert "OutOfMemoryError" in row["error"]


@pytest.mark.gpu
@pytest.mark.alone
def test_cuda_budget_caps_the_allocator(make_config, tmp_path):
    db = ResultsDB(tmp_path / "r.sqlite")
    cfg = make_config(1024, validate=False, max_steps=2, device="cuda")
    free = execute(cfg, db)
    assert free.status == "ok"
    peak = max(v for _r, p, k, v in free.metrics if k == "alloc_peak_total_bytes")
    cfg = make_config(1024, validate=False, max_steps=2, device="cuda")
    cfg.budget = f"{int(peak * 0.6) + 600 * MIB}B"  # context (~500 MB) + 60 % of the peak
    capped = execute(cfg, db)
    assert capped.status == "oom", capped.error
    assert capped.env["cuda_context_bytes"] > 100 * MIB
    assert 0 < capped.env["memory_fraction"] < 1
    cfg = make_config(1024, validate=False, max_steps=2, device="cuda")
    assert execute(cfg, db).status == "ok"  # the cap is lifted for the next run in the process


def test_recap_after_warmup_caps_by_the_grown_context(mock_cuda):
    """The cap after warm-up is (budget - (NVML used - reserved)) / total, set after freeing
    the cached blocks, on the run's device (the current one where the run names none)."""
    mock_cuda.initialized, mock_cuda.reserved = True, 2 * GIB
    mock_cuda.nvml = [3 * GIB + GIB // 4]
    facts = recap_after_warmup(4 * GIB, torch.device("cuda", 3))
    context = GIB + GIB // 4
    assert facts == {"cuda_context_after_warmup_bytes": context,
                     "allocator_cap_after_warmup_bytes": 4 * GIB - context}
    assert mock_cuda.caps == [((4 * GIB - context) / (80 * GIB), 3)] and mock_cuda.emptied == 1
    assert set(mock_cuda.asked) == {3}
    mock_cuda.current, mock_cuda.asked, mock_cuda.nvml = 2, [], [3 * GIB + GIB // 4]
    recap_after_warmup(4 * GIB, torch.device("cuda"))
    assert mock_cuda.caps[-1][1] == 2 and set(mock_cuda.asked) == {2}
    assert recap_after_warmup(None, torch.device("cuda", 0)) == {}
    assert recap_after_warmup(4 * GIB, torch.device("cpu")) == {}
    mock_cuda.initialized = False  # no run has made a context: nothing to re-measure
    assert recap_after_warmup(4 * GIB, torch.device("cuda", 0)) == {}


def test_what_nvml_counted_before_the_context_is_left_out_of_every_later_measure(mock_cuda):
    """NVML counts the driver's own reservation as used (616 MiB on an idle H200, where
    nvidia-smi shows 0): read before the context, it is subtracted from the context at the
    start and after warm-up, so the budget is what this process uses of the card."""
    mock_cuda.nvml = [616 * MIB, 616 * MIB + 530 * MIB]
    facts = apply_budget(4 * GIB, torch.device("cuda", 0))
    assert facts["cuda_context_bytes"] == 528 * MIB  # 530 MiB less the 2 MiB reserved
    assert facts["nvml_baseline_bytes"] == 616 * MIB
    mock_cuda.nvml = [616 * MIB + 730 * MIB + 2 * MIB]  # the context grew by 200 MiB
    after = recap_after_warmup(4 * GIB, torch.device("cuda", 0))
    assert after["cuda_context_after_warmup_bytes"] == 730 * MIB
    assert after["allocator_cap_after_warmup_bytes"] == 4 * GIB - 730 * MIB


@pytest.mark.parametrize("cause, status", [
    (torch.OutOfMemoryError("cap below the allocator's reserved bytes"), "oom"),
    (ConfigError("budget 4096 MB does not even hold the CUDA context (4200 MB measured by NVML)"),
     "error"),
])
def test_a_failing_recap_after_warmup_is_recorded_in_the_step_it_follows(
        make_config, monkeypatch, cause, status):
    """The re-cap runs after the last warm-up step's optimizer step, before the first measured
    step: its failure belongs to that step's `step` phase, not to the run's setup."""
    import memstudy.runner as runner_mod

    calls = []

    def recap(budget, device):
        calls.append(budget)
        raise cause
    monkeypatch.setattr(runner_mod, "recap_after_warmup", recap)
    cfg = make_config(192, validate=False, warmup_steps=1, max_steps=2)
    cfg.budget = "64GiB"  # on the CPU the tensor meter enforces it; nothing comes near it
    rec = execute(cfg, None)
    assert calls == [64 * GIB]  # in bytes, parsed once (techniques.check_early)
    assert (rec.status, rec.failed_phase) == (status, "step")
    assert str(cause) in rec.error
