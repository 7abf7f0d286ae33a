"""Small measuring helpers shared by the technique tests."""
from __future__ import annotations

from typing import Any, Callable

import torch


def saved_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """Bytes of the distinct storages autograd saves during fn(*args), parameters excluded:
    a count independent of memstudy's meters."""
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_leaf and t.requires_grad):
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(sizes.values())
