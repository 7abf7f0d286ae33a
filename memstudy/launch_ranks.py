"""Start the processes of one distributed run: spawn on one host, or join a torchrun launch.

`memstudy run --set world_size=N ...` validates the configuration once, in the parent, then
spawns N processes on this host (torch.multiprocessing, start method spawn), one per GPU
(or N CPU processes on gloo). Each process joins the process group (env:// rendezvous on
127.0.0.1), trains its part and measures its own phases; rank 0 gathers every rank's
record and stores one run (memstudy.distributed.records).

Several hosts: start the same command on every host with torchrun, which sets RANK,
WORLD_SIZE, LOCAL_RANK and the rendezvous; `memstudy run` then joins the group directly:

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank <0|1> \\
        --rdzv-backend c10d --rdzv-endpoint <host0>:29500 \\
        -m memstudy run --set world_size=2 -t mp --size 1024

Only rank 0 writes the results database (give every host the same --db path; only rank
0's host needs it).
"""
from __future__ import annotations

import copy
import datetime
import os
import pickle
import socket
import tempfile
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from memstudy.distributed.context import local_rank, resolve_backend
from memstudy.distributed.records import set_object_group
from memstudy.errors import ConfigError
from memstudy.runner import execute
from memstudy.store import ResultsDB
from memstudy.techniques.compose import make_plan, prepare_process

TIMEOUT_S = float(os.environ.get("MEMSTUDY_DIST_TIMEOUT_S", "600"))  # a rank that died ends
# the others' collectives after this long instead of hanging them forever


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def group_backend(config) -> str:
    """Validate the whole configuration (nothing started yet); return the backend to use.

    make_plan refuses world_size > 1 without a technique that owns the process group, and two
    such techniques; the owner's declaration says whether gloo can carry its CUDA tensors."""
    plan = make_plan(copy.deepcopy(config))
    owners = plan.group_owners()
    if not owners:
        raise ConfigError("a torchrun launch needs a technique that owns the process group "
                          "(see `memstudy techniques`) and world_size > 1")
    owner = plan.techniques[owners[0]]
    return resolve_backend(plan.chosen[owner.name].backend, plan.device, owner.name,
                           gloo_on_cuda=owner.gloo_on_cuda)


def run_distributed(config, db_path: str | None, progress: Callable[[str], None] | None):
    """Run `config` on world_size processes; returns rank 0's merged record (None on other
    ranks of a torchrun launch)."""
    if launched_by_torchrun():
        ws = int(os.environ["WORLD_SIZE"])
        if ws != config.world_size:
            raise ConfigError(f"torchrun started {ws} processes but world_size is "
                              f"{config.world_size}; pass --set world_size={ws}")
        record = run_in_group(config, db_path, progress)
        return record if dist_rank_env() == 0 else None
    group_backend(config)  # refuse before spawning anything
    _check_picklable(progress)
    with tempfile.TemporaryDirectory(prefix="memstudy-dist-") as tmp:
        result = Path(tmp) / "record.pkl"
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
               "WORLD_SIZE": str(config.world_size), "LOCAL_WORLD_SIZE": str(config.world_size)}
        torch.multiprocessing.spawn(_worker, args=(config, db_path, env, str(result), progress),
                                    nprocs=config.world_size, join=True)
        with open(result, "rb") as fh:
            return pickle.load(fh)


def _check_picklable(progress) -> None:
    """spawn pickles its arguments: a lambda or closure would fail inside it, after setup."""
    try:
        pickle.dumps(progress)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(f"run_distributed: the progress callback {progress!r} cannot be sent to "
                        f"the spawned ranks ({exc}); pass a module-level function such as "
                        "memstudy.console.eprint") from None


def dist_rank_env() -> int:
    return int(os.environ.get("RANK", "0"))


def _worker(index: int, config, db_path, env: dict, result: str, progress) -> None:
    os.environ.update(env, RANK=str(index), LOCAL_RANK=str(index))
    record = run_in_group(config, db_path, progress if index == 0 else None)
    if index == 0:
        with open(result, "wb") as fh:
            pickle.dump(record, fh)


def run_in_group(config, db_path, progress):
    """Join the process group (env:// rendezvous), run, leave. Rank 0 writes the database."""
    backend = group_backend(config)
    # process-level settings (allocator) before set_device initialises CUDA in this rank
    prepare_process(make_plan(copy.deepcopy(config)))
    ws = int(os.environ["WORLD_SIZE"])
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    else:  # CPU processes share the host's cores instead of each taking all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get(
            "LOCAL_WORLD_SIZE", ws))))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        set_object_group(dist.new_group(backend="gloo"))
        db = ResultsDB(db_path) if dist.get_rank() == 0 and db_path else None
        return execute(config, db, progress)
    finally:
        set_object_group(None)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
