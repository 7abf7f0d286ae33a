"""Triton kernels, each beside the plain PyTorch reference it is tested against."""
from __future__ import annotations

import os

import torch

from memstudy.errors import ConfigError

IMPLS = ("auto", "triton", "torch")  # an option choosing a technique's kernels


def interpreted() -> bool:
    """TRITON_INTERPRET=1: the kernels run on the CPU, interpreted (the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_impl(impl: str, device: torch.device, option: str) -> str:
    """'triton' or 'torch' for the choice `impl` of `option` (e.g. 'compress:impl'): auto is
    triton on CUDA, torch elsewhere; triton is refused where it cannot run, naming `option`
    (never a silent switch to the other kernels)."""
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "torch"
    if impl != "triton":
        return impl
    if device.type != "cuda" and not interpreted():
        raise ConfigError(f"{option}=triton runs Triton kernels on a CUDA GPU, and train.device "
                          f"resolves to {device}; use {option}=torch (the PyTorch references) "
                          f"or {option}=auto, or set TRITON_INTERPRET=1")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ConfigError(f"{option}=triton needs the triton package, which is not installed; "
                          f"pip install triton, or use {option}=torch") from None
    return impl
