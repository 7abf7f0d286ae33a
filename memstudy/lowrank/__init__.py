"""Low-rank weight machinery shared by `lowrank` (OIALR, [Coquelin] (docs/references.md) ch. 4) and `ab` (ch. 5).

`factors`: a Conv2d / Linear weight as U Sigma V^T (or A B) factors with the weight rebuilt in a
forward pre-hook; the eq. 4.13 base update. `oialr`: the Algorithm 1 controller.
"""
