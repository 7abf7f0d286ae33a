"""An out-of-memory error inside a training step frees that step's tensors, measured or not,
so a retry at a smaller batch (the elastic batch controller) runs in the memory it had."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from memstudy.config import MeterConfig
from memstudy.errors import PhaseFailure
from memstudy.meters import PhaseRecorder
from memstudy.runtime import Runtime
from memstudy.train import TrainState, _train_step

SIDE = 64  # one 8-channel float32 activation at batch 4: 4 * 8 * 64 * 64 * 4 B = 512 KiB


# where the loop would put micro-batches: one batch here, already on the CPU
CPU_PLACEMENT = (torch.device("cpu"), torch.contiguous_format)


def _model() -> nn.Module:
    # Sigmoid saves its *output* for backward: the case where keeping the saved tensor itself
    # (rather than a detached alias) would tie the activation and its grad_fn in a cycle.
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1), nn.Sigmoid()]
    for _ in range(3):
        layers += [nn.Conv2d(8, 8, 3, padding=1), nn.Sigmoid()]
    return nn.Sequential(*layers, nn.Conv2d(8, 3, 3, padding=1))


def _setup(budget_bytes: int):
    model = _model()
    state = TrainState()
    rt = Runtime(torch.device("cpu"), batch_size=4, loss_fn=nn.functional.mse_loss,
                 optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    state.optimizer = rt.optimizer_factory(model)
    recorder = PhaseRecorder(torch.device("cpu"), model, rt, lambda: state.optimizer,
                             MeterConfig(), cpu_limit_bytes=budget_bytes)
    recorder.in_warmup = False
    return model, rt, recorder, state


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.rand(n, 3, SIDE, SIDE, generator=g), torch.rand(n, 3, SIDE, SIDE, generator=g)


def _fail_once(model, rt, recorder, state, measured: bool) -> None:
    """One step at batch 4 that runs out of memory in the forward. The failure is dropped
    here, as the training loop drops it before retrying (a traceback held on to would keep
    the failed frames' locals alive on its own)."""
    x, y = _batch(4)
    try:
        _train_step(model, rt, state.optimizer, recorder, state, [(x, y)], CPU_PLACEMENT,
                    measured)
    except PhaseFailure as failure:
        assert isinstance(failure.cause, torch.OutOfMemoryError)
        assert failure.phase == "forward"
    else:
        pytest.fail("the batch-4 step fitted the budget; lower it")


@pytest.mark.parametrize("measured", [False, True])
def test_failed_step_frees_its_tensors_and_a_smaller_batch_fits(measured):
    # Persistent state is ~9 kB; batch 4 peaks at ~2.6 MB in the forward, batch 1 at ~0.85 MB in
    # all (forward, backward, step). Without gc.collect(): the loop does not call it either.
    model, rt, recorder, state = _setup(budget_bytes=2 << 20)
    meter = recorder.budget_meter
    before = meter.current
    _fail_once(model, rt, recorder, state, measured)
    assert meter.current == before, (
        f"{meter.current - before} bytes of the failed step are still alive")
    x, y = _batch(1)
    loss = _train_step(model, rt, state.optimizer, recorder, state, [(x, y)], CPU_PLACEMENT,
                    measured)
    assert loss > 0
    if measured:  # the retried step was measured like any other
        assert recorder.measured["forward"][-1]["tensor_peak_bytes"] > 0


def test_detached_saved_tensors_give_the_same_gradients():
    """The saved-tensor observer (on in measured steps) must not change what backward computes."""
    grads = []
    for observe in (False, True):
        model, rt, _, state = _setup(budget_bytes=1 << 40)
        seen: list[int] = []
        if observe:
            rt.saved_tensor_observers.append(lambda packed: seen.append(1))
        x, y = _batch(2)
        with rt.forward_context():
            loss = rt.loss_fn(model(x), y)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert bool(seen) == observe
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
