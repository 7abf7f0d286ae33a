"""Grid cells forked from a warm server (memstudy/grid/forkserver.py): each child runs the
cell's command with the cell's environment and log, in its own process group, and reports its
exit status; the imports are paid once, not per cell."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from memstudy.grid.forkserver import ForkServer


@pytest.fixture(scope="module")
def server():
    srv = ForkServer()
    yield srv
    srv.close()


def test_a_forked_cell_runs_its_command_into_its_log_with_its_exit_status(server, tmp_path):
    log = tmp_path / "cell.log"
    cell = server.popen(["-m", "memstudy", "techniques"], {}, log)
    assert cell.wait() == 0
    assert "checkpoint" in log.read_text()  # `memstudy techniques` listed them into the log
    assert os.getpgid(os.getpid()) != cell.pid  # its own group (the pid is gone by now)
    failing = server.popen(["-m", "memstudy", "run", "--size", "abc"], {},
                           tmp_path / "bad.log")
    assert failing.wait() == 2
    assert "memstudy: error: train.image_size = 'abc'" in (tmp_path / "bad.log").read_text()


def test_a_forked_cell_is_killed_with_its_process_group(server, tmp_path):
    cell = server.popen(["-m", "memstudy", "run", "--size", "192", "--epochs", "50", "-q"], {},
                        tmp_path / "long.log")
    assert cell.poll() is None
    deadline = time.time() + 30
    while time.time() < deadline:  # until the child has made its own process group
        try:
            if os.getpgid(cell.pid) == cell.pid:
                break
        except ProcessLookupError:
            break
        time.sleep(0.01)
    os.killpg(cell.pid, signal.SIGKILL)
    assert cell.wait() == -signal.SIGKILL


def test_a_forked_cell_starts_without_paying_the_imports(server, tmp_path):
    """The fixed cost the server removes: a cell that loads every technique module (torch
    included) returns far sooner forked than as a fresh interpreter."""
    start = time.perf_counter()
    assert server.popen(["-m", "memstudy", "techniques"], {}, tmp_path / "f.log").wait() == 0
    forked = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "memstudy", "techniques"], check=True,
                   capture_output=True, cwd=tmp_path)
    fresh = time.perf_counter() - start
    assert forked < fresh / 3, (forked, fresh)


def test_the_server_fills_the_cells_image_cache_before_them(server, tmp_path):
    """fill_caches: every image of the datasets is on disk afterwards, in the cache the cells
    read, and a cell built on it finds each image there."""
    from memstudy.config import from_dict
    from memstudy.datasets import build_datasets

    config = from_dict({"train": {"image_size": 96, "msssim_scales": 1},
                        "data": {"train_images": 3, "val_images": 2}})
    cache = tmp_path / "phantoms"
    assert server.fill_caches([{"config": config.to_dict(), "cache": str(cache)}]) >= 1
    assert len(list(cache.glob("*.npy"))) == 5
    config.data.cache_dir = str(cache)
    for dataset in build_datasets(config.data, 96, 1, 32):
        for index in range(len(dataset)):
            assert dataset._cache_path(dataset.sources[index]).is_file()


def test_a_forked_module_that_exits_with_none_exits_0(server, tmp_path):
    """sys.exit(None), as timeit's `python -m timeit` ends, is success as for the interpreter."""
    log = tmp_path / "none.log"
    assert server.popen(["-m", "timeit", "-n", "1", "-r", "1", "pass"], {}, log).wait() == 0, \
        log.read_text()


def test_an_interrupt_to_the_server_prints_no_traceback():
    """Ctrl-C reaches the runner's whole process group; the runner handles it, so the server
    must neither die of it nor print a KeyboardInterrupt traceback (it did, into a grid log)."""
    # a runner started from a shell's background job inherits SIGINT ignored, and so would the
    # server: start it with the default disposition, as from a terminal
    before = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        srv = ForkServer()
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        os.kill(srv.proc.pid, signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):  # still serving: the runner decides
            srv.proc.wait(timeout=3)
    finally:
        srv.close()
