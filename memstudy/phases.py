"""The names of what is measured, shared by the meters, the training loop, the store and reports.

A step is measured as three phases (docs/metrics.md): forward (model + loss), backward and the
optimizer step; validation is measured apart. Run-level figures (times, totals) are stored
under the pseudo-phase `run`. Torch-free.
"""
FORWARD, BACKWARD, STEP, VALIDATION = "forward", "backward", "step", "validation"
FORWARD_BACKWARD = "forward_backward"  # one fused phase where a pipeline schedule runs both
RUN = "run"  # metrics of the whole run, not of one phase

TRAIN_PHASES = (FORWARD, BACKWARD, STEP)
PHASES = (*TRAIN_PHASES, VALIDATION)
