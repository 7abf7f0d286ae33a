"""The loss's own memory inside the forward and backward phases (docs/metrics.md).

At large images the MS-SSIM loss holds full-resolution maps of its own, on top of the model's
activations. PhaseRecorder separates them: `MSSSIMLoss` tells its observers (the run's
`Runtime.loss_observers`) when its computation starts and ends, and when the gradient of its input
(the model's output) is ready, i.e. when the loss's backward is done. A `LossMeter` turns
those moments into figures for the phase in progress:
- `active`: inside the loss's forward; the recorder counts what is saved for backward then
  as the loss's (`cat_loss_saved_bytes`), not the model's (`cat_saved_bytes`);
- forward `loss_peak_bytes`: the peak while the loss ran, above the bytes live when it
  started (its temporaries and what it saves);
- backward `loss_peak_bytes`: the peak from the start of backward until the model output's
  gradient is ready (autograd runs the loss's nodes first), above the phase's start.
The forward figure needs the peak counter reset when the loss starts; the phase's own peak
before that is kept (`carried_peak`) and the recorder takes the larger of the two.
Measured by the CUDA allocator on a GPU and by the tensor meter on the CPU (when it is on).
"""
from __future__ import annotations

from typing import Callable

import torch

from memstudy.meters.tensor import LiveTensorMeter


class LossMeter:
    def __init__(self, device: torch.device, tensor_meter: Callable[[], LiveTensorMeter | None]):
        self.device, self.cuda, self.tensor_meter = device, device.type == "cuda", tensor_meter
        self.active = False
        self.carried_peak: int | None = None  # absolute peak of the phase before a reset
        self.figures: dict[str, float] = {}
        self._phase_start = 0
        self._entry = 0

    def _live_and_peak(self) -> tuple[int, int] | None:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)
        meter = self.tensor_meter()
        return None if meter is None else (meter.current, meter.peak)

    def phase_start(self) -> None:
        self.figures, self.carried_peak = {}, None
        now = self._live_and_peak()
        self._phase_start = now[0] if now else 0

    def phase_peak(self, measured_peak: int) -> int:
        """The phase's absolute peak: what the counter says, or the part before a reset."""
        return max(measured_peak, self.carried_peak or 0)

    # -- observer protocol (quality.MSSSIMLoss) --------------------------------------------
    def loss_started(self) -> None:
        self.active = True
        now = self._live_and_peak()
        if now is None:
            return
        self._entry = now[0]
        self.carried_peak = max(self.carried_peak or 0, now[1])
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.tensor_meter().reset_peak()

    def loss_finished(self) -> None:
        self.active = False
        now = self._live_and_peak()
        if now is None:
            return
        self._keep("loss_peak_bytes", now[1] - self._entry)
        if not self.cuda:  # the tensor meter's peak can be restored; the allocator's cannot
            meter = self.tensor_meter()
            meter.peak = max(meter.peak, self.carried_peak or 0)

    def loss_backward_done(self) -> None:
        now = self._live_and_peak()
        if now is not None:
            self._keep("loss_peak_bytes", now[1] - self._phase_start)

    def _keep(self, name: str, value: int) -> None:
        self.figures[name] = max(self.figures.get(name, 0), value)
