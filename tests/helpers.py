"""Small measuring helpers shared by the technique tests."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
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


def hooked_grads(model, x, hooks=None) -> list[torch.Tensor]:
    """Parameter gradients of mean(model(x)^2), with saved-tensor `hooks` (pack, unpack)
    around the forward when given: how offload / compression round trips are compared."""
    model.zero_grad(set_to_none=True)
    if hooks is None:
        out = model(x)
    else:
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            out = model(x)
    out.square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@dataclass
class Step:
    loss: float
    grads: dict[str, torch.Tensor]  # after backward, before the optimizer step
    buffers: dict[str, torch.Tensor]  # at the end (BatchNorm statistics)
    forward: dict[str, float]  # the PhaseRecorder's forward figures
    notes: dict
    build: Any


def measured_step(techniques: list[str], optimizer_step: bool) -> Step:
    """One measured forward + backward (and optimizer step) of the composed pipeline at 192 px,
    on a fixed random batch, with the tensor meter on."""
    from conftest import small_config
    from memstudy.config import MeterConfig
    from memstudy.meters import PhaseRecorder
    from memstudy.techniques.compose import build_pipeline, make_plan

    build = build_pipeline(make_plan(small_config(techniques=techniques)))
    model, rt = build.model, build.runtime
    optimizer = rt.optimizer_factory(model) if optimizer_step else None
    recorder = PhaseRecorder(build.device, model, rt, lambda: optimizer, MeterConfig(tensor="on"))
    gen = torch.Generator().manual_seed(7)
    x, y = torch.rand(1, 1, 192, 192, generator=gen), torch.rand(1, 1, 192, 192, generator=gen)
    with recorder.step(measured=True):
        with recorder.phase("forward"):
            loss = rt.forward(model, x, y)
        with recorder.phase("backward"):
            rt.backward(loss)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if optimizer is not None:
            with recorder.phase("step"):
                rt.step(optimizer)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return Step(loss.item(), grads, buffers, recorder.summary()["forward"], build.notes, build)


def run_interpreted(module: str, call: str) -> None:
    """`module.call` (a test module of this folder and a call such as "check(0.5)") in a child
    process with TRITON_INTERPRET=1, which must be set before triton is first imported (its
    own library functions are decorated then) while other tests may already have imported it;
    fails with the child's error."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import {module} as t; t.{call}")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
