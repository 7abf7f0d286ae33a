"""Grids of technique combinations x image sizes x batch sizes x seeds: `memstudy grid SPEC`.

Every cell is expanded and validated (`make_plan`) before any runs; an invalid cell is
reported with its reason and never run. Each valid cell runs in its own process
(`python -m memstudy run --config <cell>.toml`), so one cell's memory state or crash cannot
touch another: each GPU cell on its own disjoint GPUs (CUDA_VISIBLE_DEVICES per child; as
many as `gpus_needed`: world_size, or 2 for mp:mode=local; it waits until they are free),
one at a time on the CPU. Resuming is by config hash: a cell whose hash is recorded is skipped.

Killing is safe because the store writes a run in one transaction: a cell killed mid-run
(by its timeout, by SIGKILL, or with the runner on Ctrl-C / SIGKILL, since children die
with their parent) leaves nothing, and a rerun runs it again. A cell that exceeds its
timeout is recorded as status 'error', failed_phase 'timeout'. docs/grid.md has the format.
"""
from memstudy.grid.cells import (CRASHED, KILLED, CellProcess, cells_folder, record_timeout,
                                 Watch, run_isolated, to_toml, write_cell_config)
from memstudy.grid.scheduler import GpuSlots, GridResult, run_grid, visible_gpus
from memstudy.grid.spec import (Cell, GridSpec, cell_config, cell_table, config_hash, expand,
                                gpus_needed, load_spec, plan_outcomes, product_sets,
                                spec_from_dict)

__all__ = ["CRASHED", "KILLED", "Cell", "CellProcess", "GpuSlots", "GridResult", "GridSpec",
           "cell_config", "cell_table", "cells_folder", "config_hash", "expand", "gpus_needed",
           "load_spec", "plan_outcomes", "product_sets", "record_timeout", "run_grid", "run_isolated", "Watch", "spec_from_dict",
           "to_toml", "visible_gpus", "write_cell_config"]
