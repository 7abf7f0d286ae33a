"""The CUDA caching allocator's settings in this process: applied, inherited, and read back.

The allocator reads its settings once, when CUDA starts. memstudy's `allocator` technique
gives them through `configure` (before CUDA initialises); otherwise the allocator takes them
from the environment (PYTORCH_CUDA_ALLOC_CONF, or PYTORCH_ALLOC_CONF on torch >= 2.9), else
runs with PyTorch's defaults. Every CUDA run records (runner.execute; docs/metrics.md):
- `allocator_settings`: the settings string the allocator was configured with: what memstudy
  gave it in this process (this run or an earlier one: it cannot be reconfigured), else the
  environment's, else '' (PyTorch's defaults); `allocator_settings_source` says which.
  PyTorch's own getter for that string (`torch._C._accelerator_getAllocatorSettings`) is not
  relied on: on torch 2.11 with an H100 it returned '' for a run configured with
  expandable segments, while on torch 2.14 it returns the string.
- after the run, `allocator_reported`: the backend (`torch.cuda.memory.get_allocator_backend`)
  and the values the allocator parsed, from its memory snapshot
  (`torch.cuda.memory._snapshot()["allocator_settings"]`: expandable_segments,
  max_split_size, garbage_collection_threshold); `allocator_verified`: whether they are the
  values the string asks for (keys it leaves out: PyTorch's defaults), with
  `allocator_mismatch` naming the ones that differ; absent where PyTorch reports no values.
Setting the environment variable in this process instead was tried and reverted: child
processes (grid cells, tests) inherit it, and the technique refuses a set variable.
"""
from __future__ import annotations

import os

import torch

MIB = 1 << 20
ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_applied: str | None = None  # the settings memstudy gave this process's allocator


def applied() -> str | None:
    return _applied


def configure(text: str) -> None:
    """Give the allocator `text` (before CUDA initialises; PyTorch raises on unknown keys)."""
    global _applied
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if setter is None:
        torch.cuda.memory._set_allocator_settings(text)
    else:
        setter(text)
    _applied = text


def inherited() -> str:
    """The settings the process environment gives the allocator ('' when none)."""
    return ",".join(v for v in (os.environ.get(var, "") for var in ENV_VARS) if v)


def describe() -> dict[str, str]:
    """The settings string this process's allocator was configured with, and its source."""
    if _applied is not None:  # memstudy configured it (this run or an earlier one here)
        return {"allocator_settings": _applied, "allocator_settings_source": "allocator technique"}
    text = inherited()
    return {"allocator_settings": text,
            "allocator_settings_source": "environment" if text else "defaults"}


def parse(text: str) -> dict[str, str]:
    """'key:value,key:value' -> {key: value} (the PYTORCH_CUDA_ALLOC_CONF form)."""
    pairs = (item.split(":", 1) for item in text.split(",") if ":" in item)
    return {key.strip(): value.strip() for key, value in pairs}


def expected_values(text: str) -> dict[str, object]:
    """What the allocator should report for a settings string (unset keys: PyTorch's defaults)."""
    given = parse(text)
    split_mb = int(given.get("max_split_size_mb", 0))
    return {"expandable_segments": given.get("expandable_segments", "False") == "True",
            "garbage_collection_threshold": float(given.get("garbage_collection_threshold", 0.0)),
            "max_split_size_mb": split_mb}


def reported(device: torch.device) -> dict[str, object]:
    """What PyTorch's CUDA caching allocator reports it runs with ({} where it reports nothing)."""
    facts: dict[str, object] = {"backend": torch.cuda.memory.get_allocator_backend()}
    snapshot = torch.cuda.memory._snapshot(device)
    values = snapshot.get("allocator_settings") if isinstance(snapshot, dict) else None
    if not values:
        return facts
    if "expandable_segments" in values:
        facts["expandable_segments"] = bool(values["expandable_segments"])
    if "garbage_collection_threshold" in values:
        facts["garbage_collection_threshold"] = float(values["garbage_collection_threshold"])
    if "max_split_size" in values:  # bytes; SIZE_MAX (-1 once cast to int64) = unlimited
        split = int(values["max_split_size"])
        facts["max_split_size_mb"] = split // MIB if 0 < split < (1 << 62) else 0
    return facts


def mismatches(text: str, facts: dict[str, object]) -> list[str]:
    """The reported values that differ from what `text` asks for ('key: asked vs reported')."""
    return [f"{key}: {want!r} asked, {facts[key]!r} reported"
            for key, want in expected_values(text).items() if key in facts and facts[key] != want]


def read_back(text: str, device: torch.device) -> dict[str, object]:
    """The record's check, after the run, of the allocator against the settings `text`."""
    facts = reported(device)
    record: dict[str, object] = {"allocator_reported": facts}
    if set(facts) & set(expected_values("")):
        wrong = mismatches(text, facts)
        record["allocator_verified"] = not wrong
        if wrong:
            record["allocator_mismatch"] = wrong
    return record
