"""Tri-Accel ([Tri-Accel] (docs/references.md)): per-unit adaptive precision, curvature-scaled learning rates and a
memory-elastic batch size, driven by one control loop. The technique is `tri_accel`
(memstudy/techniques/tri_accel.py); reports use `control_rows` and `run_efficiency`."""
from memstudy.triaccel.score import control_rows, efficiency_score, run_efficiency

__all__ = ["control_rows", "efficiency_score", "run_efficiency"]
