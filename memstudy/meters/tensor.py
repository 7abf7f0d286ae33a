"""Tensor-level memory meter: works on any device, the CPU included.

A TorchDispatchMode sees every tensor an ATen op returns; each new storage is counted
once (views share it) and uncounted by a weak-reference callback when it is freed. So
`current` is the bytes of live storages created while the meter was on, and `peak` its
maximum. With `limit_bytes` set, exceeding it raises torch.OutOfMemoryError, which lets a
memory budget be emulated on the CPU.

Cost: one Python call per ATen op. The harness turns it on only for measured steps and
measures its own overhead (docs/metrics.md).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


_ALIASING: dict[object, bool] = {}


def _returns_alias(func) -> bool:
    """True if an op's results alias its inputs (views, in-place and out= variants)."""
    known = _ALIASING.get(func)
    if known is None:
        known = _ALIASING[func] = any(r.alias_info is not None for r in func._schema.returns)
    return known


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (FSDP2 parameters, gradients, optimizer state)."""
    return t.to_local() if hasattr(t, "device_mesh") and hasattr(t, "to_local") else t


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    t = local_tensor(t)
    return (str(t.device), t.untyped_storage().data_ptr())


class LiveTensorMeter(TorchDispatchMode):
    def __init__(self, limit_bytes: int | None = None, baseline_bytes: int = 0):
        super().__init__()
        self.limit_bytes = limit_bytes
        self.live: dict[tuple[str, int], tuple[int, weakref.ref]] = {}
        self.current = baseline_bytes  # bytes alive before the meter started (parameters)
        self.peak = baseline_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _returns_alias(func):  # views and in-place results reuse an existing storage
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        t = local_tensor(t)  # a DTensor (FSDP2) has no storage of its own; its shard has
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = (str(t.device), storage.data_ptr())
        if nbytes == 0 or key in self.live:
            return
        self.live[key] = (nbytes, weakref.ref(storage, lambda _r, k=key: self._release(k)))
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
        if self.limit_bytes is not None and self.current > self.limit_bytes:
            raise torch.OutOfMemoryError(
                f"memstudy budget: {self.current} bytes of live tensors exceed the budget of "
                f"{self.limit_bytes} bytes (tensor meter)")

    def _release(self, key: tuple[str, int]) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]

    def reset_peak(self) -> None:
        self.peak = self.current

    def live_keys(self) -> set[tuple[str, int]]:
        return set(self.live)

    def bytes_of(self, keys: set[tuple[str, int]]) -> int:
        return sum(self.live[k][0] for k in keys if k in self.live)


def unique_storage_bytes(tensors: Any, exclude: set[tuple[str, int]] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (views and repeats counted once)."""
    seen: set[tuple[str, int]] = set(exclude or ())
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        t = local_tensor(t)
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def saved_tensors_of_graph(root: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor the autograd graph under `root` saved for backward.

    Walks grad_fn nodes and reads their `_saved_*` attributes: an account of saved tensors
    independent of saved-tensor hooks, used to check the meter. Do not call on a graph with
    checkpointed regions: reading a saved tensor there triggers recomputation.
    """
    found, seen, stack = [], set(), [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                items = value if isinstance(value, (tuple, list)) else [value]
                found.extend(v for v in items if isinstance(v, torch.Tensor))
        stack.extend(fn for fn, _ in node.next_functions)
    return found
