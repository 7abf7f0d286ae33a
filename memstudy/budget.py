"""Memory-budget emulation: make a large device behave like a small one (`--budget 8GiB`).

On CUDA the budget covers what an 8 GB card would hold: the CUDA context (driver, kernels
and library handles, invisible to PyTorch's allocator) plus the caching allocator's reserved
memory. The context is measured with NVML, then the allocator is capped with
`torch.cuda.set_per_process_memory_fraction((budget - context) / total)`: an allocation that
would make the reserved memory exceed the cap raises torch.OutOfMemoryError, which the run
records as 'oom' in the phase it happened in. docs/budget.md says what this cannot capture
(fragmentation of a smaller card, cuDNN workspace choices, NVML's view vs the allocator's).

On the CPU the budget is enforced by the tensor meter (PhaseRecorder(cpu_limit_bytes=...)):
live tensor bytes, parameters and optimizer state included, may not exceed it.

A budget that cannot hold the run's fixed part is refused before anything is built, not run
into an 'oom' that looks like a measurement: 0 (or less), one above the device's memory, one
below the CUDA context plus the model's parameters (on the CPU: below the parameters). The
parameters are counted on the plain U-Net; for plans that change or shard them (structural
techniques, FSDP) only the context is checked, since their size is known only once built.
"""
from __future__ import annotations

from typing import Any

import torch

from memstudy.byte_sizes import mb, size_text
from memstudy.config import budget_size
from memstudy.errors import ConfigError


def budget_bytes(budget: str | int | None) -> int | None:
    """A budget as written (config.budget) in bytes; a run parses it once, in
    techniques.check_early (Plan.budget_bytes)."""
    return None if budget is None else budget_size(budget)


def nvml_used(index: int) -> int:
    """Device-level used bytes (nvidia-smi's figure) of the visible CUDA device `index`.

    torch maps the index through CUDA_VISIBLE_DEVICES; an explicit index keeps the call from
    creating a CUDA context, so it can be taken before the context exists."""
    return torch.cuda.device_memory_used(torch.device("cuda", index))


# device index -> NVML's used bytes before this process created its CUDA context
_BEFORE_CONTEXT: dict[int, int] = {}


def note_baseline(index: int) -> None:
    """Read NVML's used bytes of GPU `index` before this process's CUDA context exists (once).

    NVML counts as used memory that no process of ours holds: what the driver reserves for
    itself outside CUDA's total (nvidia-smi shows 0 MiB used on an idle H200 while NVML's
    used is 616 MiB: NVML's total minus CUDA's; driver 580) and what other processes held then.
    A budget is what this process would need of a card, so that is left out of it."""
    if index not in _BEFORE_CONTEXT and not torch.cuda.is_initialized():
        _BEFORE_CONTEXT[index] = nvml_used(index)


def device_baseline(index: int) -> int:
    """NVML's used bytes of GPU `index` before this process's context (note_baseline); 0 where
    torch had started CUDA before it could be read: unknown, so counted against the budget."""
    return _BEFORE_CONTEXT.get(index, 0)


def process_device_bytes(index: int) -> int:
    """The device memory this process uses, as NVML sees it: used minus the baseline."""
    return nvml_used(index) - device_baseline(index)


def cuda_context_bytes(device: torch.device) -> int:
    """Bytes the CUDA context of this process occupies on `device`, measured by NVML: the
    process's device memory (process_device_bytes) minus the allocator's reserved bytes,
    creating the context first where it does not exist yet (exact unless another process
    allocates meanwhile)."""
    index = device.index if device.index is not None else 0
    if not torch.cuda.is_initialized():
        note_baseline(index)
        torch.cuda.init()
    torch.empty(1, device=torch.device("cuda", index))  # the context is created lazily
    torch.cuda.synchronize(index)
    return process_device_bytes(index) - torch.cuda.memory_reserved(index)


def apply_budget(limit: int | None, device: torch.device,
                 parameter_bytes: int = 0) -> dict[str, Any]:
    """Apply the budget of one run, `limit` bytes (None: none; the config's budget as parsed
    once, by techniques.check_early), on `device`; returns the facts to store with the run.
    Refuses (ConfigError) a budget that cannot hold the CUDA context (CPU: nothing) plus
    `parameter_bytes` (parameter_floor), or one above the device's memory.

    CUDA without a budget resets the cap, so an earlier capped run in the same process
    (notebooks, tests) cannot constrain this one. The CPU needs no cap here: the runner
    hands the budget to the tensor meter."""
    if device.type != "cuda":
        if limit is None:
            return {}
        check_floor(limit, 0, parameter_bytes, "the tensor meter counts them on the CPU")
        return {"budget_bytes": limit, "budget_enforced_by": "tensor meter"}
    if device.index is not None:
        index = device.index
    else:  # asking torch for the current device would initialise CUDA before the measurement
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    note_baseline(index)  # before torch reads the properties, which initialises its CUDA
    if limit is None:
        if torch.cuda.is_initialized():
            torch.cuda.set_per_process_memory_fraction(1.0, index)
        return {"nvml_baseline_bytes": device_baseline(index)}
    props = torch.cuda.get_device_properties(index)
    check_device_total(limit, props.total_memory, props.name)
    context = cuda_context_bytes(torch.device("cuda", index))
    check_floor(limit, context, parameter_bytes, "measured by NVML")
    total = props.total_memory
    fraction = allocator_fraction(limit, context, total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return {"budget_bytes": limit, "budget_enforced_by": "allocator cap",
            "cuda_context_bytes": context, "allocator_cap_bytes": int(fraction * total),
            "memory_fraction": fraction, "nvml_baseline_bytes": device_baseline(index)}


def recap_after_warmup(limit: int | None, device: torch.device) -> dict[str, Any]:
    """Re-measure the CUDA context once warm-up has run and lower the allocator's cap by its growth.

    The context measured before the first kernel is not the context of a training run: CUDA
    loads kernels lazily and cuDNN loads its engines on first use, so device memory outside
    PyTorch's allocator grows during the first steps (seen on an H100 at 4188 px: from about
    0.5 GB to 1.2 GB). A budget that kept the first cap would let NVML's figure exceed it. After
    warm-up the context is the process's device memory (process_device_bytes) minus the
    allocator's reserved bytes, the cached blocks are
    released and the cap becomes budget - context, so the measured steps stay inside the budget
    at device level (`budget_headroom_bytes` in docs/metrics.md says whether they did).
    `limit`: the budget in bytes, as apply_budget takes it."""
    if limit is None or device.type != "cuda" or not torch.cuda.is_initialized():
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(index)
    torch.cuda.empty_cache()  # warm-up's cached blocks must fit under the new cap too
    context = process_device_bytes(index) - torch.cuda.memory_reserved(index)
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = allocator_fraction(limit, context, total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return {"cuda_context_after_warmup_bytes": context,
            "allocator_cap_after_warmup_bytes": int(fraction * total)}


def check_device_total(limit: int, total: int, name: str) -> None:
    if limit > total:
        raise ConfigError(f"budget {size_text(limit)} exceeds the {mb(total):.0f} MB of the "
                          f"{name}; lower --budget to at most {mb(total):.0f}MiB or drop it")


def check_warmup(limit: int | None, device: torch.device, warmup_steps: int) -> None:
    """Refuse a CUDA budget without a warm-up step: the first cap (apply_budget) leaves out the
    context's growth as kernels load (recap_after_warmup sets the cap that holds), so a
    measured first step can exceed the budget at device level (docs/budget.md)."""
    if limit is None or device.type != "cuda" or warmup_steps >= 1:
        return
    raise ConfigError(f"budget {size_text(limit)} on CUDA needs train.warmup_steps >= 1: the "
                      "allocator's cap is set by the CUDA context as it is after warm-up; set "
                      "train.warmup_steps = 1 or more, or leave the budget out")


def check_floor(limit: int, context: int, parameter_bytes: int, how: str) -> None:
    """Refuse a budget that cannot hold the CUDA context plus the model's parameters."""
    floor = context + parameter_bytes
    if limit > floor:
        return
    parts = ([f"the CUDA context ({mb(context):.0f} MB, {how})"] if context else []) + (
        [f"the model's parameters ({mb(parameter_bytes):.0f} MB)"] if parameter_bytes else [])
    held = " plus ".join(parts) or "anything"
    raise ConfigError(f"budget {size_text(limit)} cannot hold {held}, before any activation; "
                      f"raise --budget above {mb(floor):.0f}MiB")


def allocator_fraction(limit: int, context: int, total: int) -> float:
    """The allocator's share of the device that leaves `limit` bytes in all, context included."""
    if limit > total:
        raise ConfigError(f"budget {size_text(limit)} exceeds the GPU's {mb(total):.0f} MB; "
                          "lower budget or drop it")
    if limit <= context:
        raise ConfigError(f"budget {size_text(limit)} does not even hold the CUDA context "
                          f"({mb(context):.0f} MB measured by NVML); raise budget")
    return (limit - context) / total
