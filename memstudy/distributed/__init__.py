"""Distributed execution for memstudy: process groups, launching, per-rank records, p2p.

`context` answers "who am I" (rank, world size, device, backend); memstudy.launch_ranks (one
layer up: it runs the harness) starts the processes of one run; `records` merges every
rank's measurements into the single run that rank 0 stores; `p2p` the transfers between ranks
(features and gradients between the halves of the model-parallel split,
memstudy/techniques/mp/split.py, which pipeline runs too; the GradScalers' overflow agreement).
"""
from memstudy.distributed.context import (RANK_MAX, RANK_MEAN, is_distributed, local_rank, rank,
                                          world_size)

__all__ = ["RANK_MAX", "RANK_MEAN", "is_distributed", "local_rank", "rank", "world_size"]
