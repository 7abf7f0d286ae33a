"""CUDA-only paths that the CPU suite cannot break: the per-phase peak reset and the budget cap
computed with the CUDA context. Each test fails when its mechanism is removed: without
`reset_peak_memory_stats` before a phase, a small phase after a large one reports the large
one's peak; with a cap that ignores the context, the allocator takes the whole budget.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from memstudy.config import MeterConfig
from memstudy.errors import ConfigError
from memstudy.meters import PhaseRecorder
from memstudy.runner import execute
from memstudy.runtime import Runtime

pytestmark = [pytest.mark.gpu, pytest.mark.alone]  # budgets measure the whole device
MIB = 1 << 20
BUDGET = "6GiB"
# The stored cap is int(fraction * total) with fraction = (budget - context) / total: equal to
# budget - context up to float rounding, far below a MiB. The allocator itself is probed to
# 64 MiB, above its rounding of large blocks (2 MiB) and the blocks it keeps cached.
STORED_TOLERANCE, PROBE_TOLERANCE = MIB, 64 * MIB


def _fill(nbytes: int, device: torch.device) -> None:
    block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    block.fill_(1)
    del block


def test_a_small_phase_after_a_large_one_reports_its_own_peak():
    device = torch.device("cuda", 0)
    model = nn.Linear(4, 4).to(device)
    runtime = Runtime(device=device, batch_size=1, loss_fn=None, optimizer_factory=None)
    recorder = PhaseRecorder(device, model, runtime, lambda: None, MeterConfig(nvml=False))
    with recorder.phase("forward", measure=True):
        _fill(512 * MIB, device)
    with recorder.phase("backward", measure=True):
        _fill(16 * MIB, device)
    recorder.close()
    large = recorder.measured["forward"][-1]["alloc_peak_bytes"]
    small = recorder.measured["backward"][-1]["alloc_peak_bytes"]
    assert large >= 512 * MIB
    assert 16 * MIB <= small < 18 * MIB, f"backward peak {small / MIB:.0f} MiB: not reset"


def _probe_cap(cap: int, device: torch.device) -> tuple[bool, bool]:
    """Whether the allocator accepts a block just under and just over `cap` (reserved
    memory after freeing the cache included)."""
    torch.cuda.empty_cache()
    room = cap - torch.cuda.memory_reserved(device)

    def fits(nbytes: int) -> bool:
        try:
            _fill(nbytes, device)
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            torch.cuda.empty_cache()
    return fits(room - PROBE_TOLERANCE), fits(room + PROBE_TOLERANCE)


def test_the_budget_cap_leaves_the_cuda_context_out(make_config):
    """A CUDA budget needs a warm-up step (budget.check_warmup): the first cap leaves out the
    context as it is at the start, the second the context as warm-up left it."""
    device = torch.device("cuda", 0)
    cfg = make_config(512, validate=False, warmup_steps=1, max_steps=2, device="cuda")
    cfg.budget = BUDGET
    rec = execute(cfg, None)
    assert rec.status == "ok", rec.error
    env = rec.env
    context = env["cuda_context_bytes"]
    assert context > 100 * MIB  # NVML sees the context (about 500 MB on an H100)
    assert abs(env["allocator_cap_bytes"] - (env["budget_bytes"] - context)) <= STORED_TOLERANCE
    grown = env["cuda_context_after_warmup_bytes"]  # re-capped by the context after warm-up
    assert abs(env["allocator_cap_after_warmup_bytes"]
               - (env["budget_bytes"] - grown)) <= STORED_TOLERANCE
    run = {name: v for r, phase, name, v in rec.metrics if r == 0 and phase == "run"}
    baseline = env["nvml_baseline_bytes"]  # NVML's used bytes before this process's context
    assert run["nvml_process_peak_bytes"] == run["nvml_peak_total_bytes"] - baseline
    assert run["budget_headroom_bytes"] == env["budget_bytes"] - run["nvml_process_peak_bytes"]
    cap = env["allocator_cap_after_warmup_bytes"]
    under, over = _probe_cap(cap, device)
    assert under and not over, f"the allocator's cap is not {cap / MIB:.0f} MiB"
    lifted = make_config(512, validate=False, warmup_steps=0, max_steps=1, device="cuda")
    assert execute(lifted, None).status == "ok"  # the next run without a budget is uncapped


def test_budgets_the_device_cannot_honour_are_refused_before_the_build(make_config):
    props = torch.cuda.get_device_properties(0)
    cfg = make_config(512, validate=False, warmup_steps=1, max_steps=2, device="cuda")
    cfg.budget = f"{props.total_memory + (1 << 30)}B"
    with pytest.raises(ConfigError, match=f"exceeds the .* MB of the {re.escape(props.name)}"):
        execute(cfg, None)
    cfg.budget = "120MiB"  # below any CUDA context plus the U-Net's 93 MiB of parameters
    with pytest.raises(ConfigError, match="cannot hold the CUDA context"):
        execute(cfg, None)
