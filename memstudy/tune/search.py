"""The Propulate side of `memstudy tune` (memstudy/tune/__init__.py holds the spec, trials and fitness):
one Propulate worker per MPI process, `islands` islands, each worker's loss function a
`Trials` object that trains (or finds recorded) one run per proposal.

Propulate 1.2.2 (the newest release on PyPI) stalls a search whose island has one worker, i.e.
every single-process `memstudy tune`: after each generation the worker that wrote the island's
checkpoint hands the turn to the next worker of its island with a blocking `comm.send`; with one
worker that next worker is itself, and no receive is ever posted before the send. MPICH (the
`mpich` wheel mpi4py loads) does not buffer a send to oneself, so the first trial is trained and
recorded and the process then spins in MPI_Send for ever. Upstream fixed it after the release
(Helmholtz-AI-Energy/propulate commit 8b11e6e, "fixed checkpoint dumping worker communication for
island sizes of 1": skip the send and keep the turn when the island has one worker);
`patch_single_worker_islands` applies the same two changes to the installed Propulator class.
"""
from __future__ import annotations

import os
import pickle
import random
from typing import Callable

from memstudy.errors import ConfigError
from memstudy.tune import Trials, TuneSpec, search_limits

PATCHED = "_memstudy_single_worker_islands"


def patch_single_worker_islands(propulator_cls: type) -> None:
    """Upstream 8b11e6e on `propulator_cls` (propulate.Propulator; Pollinator and Migrator
    inherit both methods): an island of one worker writes its checkpoint without messaging
    itself and always keeps the turn to write the next one. Islands of several workers keep
    Propulate's own code. Idempotent."""
    if getattr(propulator_cls, PATCHED, False):
        return
    dump_with_handover = propulator_cls._dump_checkpoint
    next_dumper = propulator_cls._determine_worker_dumping_next

    def _dump_checkpoint(self) -> None:
        if self.island_comm.size > 1:
            return dump_with_handover(self)
        write_population_checkpoint(self.checkpoint_path, self.island_idx, self.population)

    def _determine_worker_dumping_next(self) -> bool:
        if self.island_comm.size == 1:
            return True
        return next_dumper(self)

    propulator_cls._dump_checkpoint = _dump_checkpoint
    propulator_cls._determine_worker_dumping_next = _determine_worker_dumping_next
    setattr(propulator_cls, PATCHED, True)


def write_population_checkpoint(checkpoint_path, island_idx: int, population: list) -> None:
    """What Propulate's _dump_checkpoint writes: the previous pickle kept as .bkp (Propulate
    reads it when the newest is missing), then the population; written to a temporary file
    first, so an interrupt never leaves a truncated pickle that a resumed search cannot load."""
    target = checkpoint_path / f"island_{island_idx}_ckpt.pickle"
    partial = target.with_suffix(".partial")
    with open(partial, "wb") as f:
        pickle.dump(population, f)
    if os.path.isfile(target):
        os.replace(target, target.with_suffix(".bkp"))
    os.replace(partial, target)


def checkpoint_dir(spec: TuneSpec, db) -> str:
    """The spec's checkpoint folder, else `<db>.propulate` beside the results database, so a
    search started again on the same database finds its population."""
    return spec.checkpoint or f"{db.path}.propulate"


def run_tune(spec: TuneSpec, db, progress: Callable[[str], None] | None = None) -> Trials:
    """Propulate over the MPI world: one worker per rank, `spec.islands` islands."""
    try:
        from mpi4py import MPI
        from propulate import Islands, Propulator
        from propulate.utils import get_default_propagator
    except (ImportError, RuntimeError) as exc:  # RuntimeError: mpi4py found no MPI library
        raise ConfigError(f"memstudy tune needs Propulate and an MPI library (docs/tune.md, "
                          f"'Installation'): {exc}") from None
    comm = MPI.COMM_WORLD
    if spec.islands > comm.size:
        raise ConfigError(f"tune spec: islands = {spec.islands} but only {comm.size} MPI "
                          f"process(es); start with mpirun -n {spec.islands} or lower islands")
    patch_single_worker_islands(Propulator)
    trials = Trials(spec, db, progress, _rank_device(comm.rank))
    rng = random.Random(spec.seed + comm.rank)
    propagator = get_default_propagator(spec.pop_size, search_limits(spec), rng=rng)
    checkpoint = checkpoint_dir(spec, db)
    os.makedirs(checkpoint, exist_ok=True)
    islands = Islands(trials, propagator, rng, generations=spec.generations,
                      num_islands=spec.islands, checkpoint_path=checkpoint,
                      migration_probability=0.9 if spec.islands > 1 else 0.0)
    islands.propulate()
    return trials


def _rank_device(rank: int) -> str | None:
    import torch

    if torch.cuda.is_available():
        return f"cuda:{rank % torch.cuda.device_count()}"
    return None

