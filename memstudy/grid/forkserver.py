"""Grid cells forked from a warm process: imports paid once, a fresh CUDA context per cell.

A cell started as `python -m memstudy run ...` pays process start and the imports of torch,
segmentation-models-pytorch and memstudy (seconds, more on a busy machine) before its first
step, every time. The fork server is one process that does those imports once, never touches
CUDA, and forks a child per cell: the child starts with every module loaded and creates its own
CUDA context and caching allocator on first use, exactly as a fresh process would, so what a
cell measures is unchanged (the server checks it has not initialised CUDA before each fork).

Each child runs the cell's command line (`-m memstudy --db ... run --config ...`, what a
subprocess cell would give the interpreter, run by runpy as `python -m` does) in its
own process group (a timeout kills it and what it started), with the
cell's environment (CUDA_VISIBLE_DEVICES is read when CUDA starts, in the child), its output in
the cell's log, and dies with the server, which dies with the grid runner (PR_SET_PDEATHSIG).
Phantoms are cached on disk beside the cells (`$MEMSTUDY_CACHE`, unless set), so a size is
generated once per grid. `MEMSTUDY_FORKSERVER=0` starts each cell as a subprocess instead.

Protocol (one Unix-socket connection per cell): the runner sends one JSON line
{"argv" (the interpreter's arguments), "env", "log"}; the server answers {"pid"} when the child is forked and {"returncode"}
(negative: killed by that signal) when it has exited. Before the cells, the runner may send
{"data": [{"config", "cache"}, ...]}: each entry's images (phantoms generated, or files
decoded) are written to its on-disk cache by forked workers over the CPU's cores, so no cell
waits for them with its GPU idle; the server answers {"workers_ok": n} when they are done.

The server itself runs no tensor code, only imports: an autograd pass (even on the meta
device) starts the CUDA driver and the autograd engine's device threads, and every child
forked after that fails to initialise CUDA (seen on an H100). Work for the cells is done in
forked workers, never in the server.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENABLED = os.environ.get("MEMSTUDY_FORKSERVER", "1") != "0"


class ForkedCell:
    """The runner's handle on one forked cell: Popen's pid / poll / wait / returncode."""

    def __init__(self, conn: socket.socket):
        self.conn, self.returncode = conn, None
        self._buffer = b""
        self.pid = self._message()["pid"]

    def _message(self, block: bool = True) -> dict | None:
        self.conn.setblocking(block)
        while b"\n" not in self._buffer:
            try:
                chunk = self.conn.recv(4096)
            except BlockingIOError:
                return None
            if not chunk:  # the server died: the cell died with it (PR_SET_PDEATHSIG)
                return {"returncode": -signal.SIGKILL}
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None and (message := self._message(block=False)):
            self.returncode = message["returncode"]
            self.conn.close()
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self._message()["returncode"]
            self.conn.close()
        return self.returncode


class ForkServer:
    """Client side: starts the server process and asks it for cells."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="memstudy-forkserver-"))
        self.address = str(self.folder / "socket")
        parent = os.getpid()

        serve_here = "import sys; from memstudy.grid.forkserver import serve; serve(sys.argv[1])"
        try:  # interrupted while it imports (Ctrl-C, SIGTERM): no server or folder left behind
            self.proc = subprocess.Popen([sys.executable, "-c", serve_here, self.address],
                                         stdout=subprocess.PIPE,
                                         preexec_fn=lambda: die_with_parent(parent))
            ready = self.proc.stdout.readline()  # after the imports
        except BaseException:
            self.close()
            raise
        if ready.strip() != b"ready":
            self.close()
            raise RuntimeError(f"the grid's fork server did not start (exit {self.proc.poll()})")

    def popen(self, argv: list[str], env: dict[str, str], log: str | Path) -> ForkedCell:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.address)
        conn.sendall(json.dumps({"argv": argv, "env": env, "log": str(log)}).encode() + b"\n")
        return ForkedCell(conn)

    def fill_caches(self, data: list[dict]) -> int:
        """Have the server's workers fill the image caches of `data` ({"config": a RunConfig
        dict, "cache": its folder}) before the cells that read them start; returns how many
        workers ended well."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.address)
            conn.sendall(json.dumps({"data": list(data)}).encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    raise RuntimeError("the grid's fork server died while caching images")
                reply += chunk
        return json.loads(reply)["workers_ok"]

    def close(self) -> None:
        proc = getattr(self, "proc", None)  # None: interrupted before the server started
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for path in (Path(self.address), self.folder):
            try:
                path.rmdir() if path.is_dir() else path.unlink()
            except OSError:
                pass


_SERVER: ForkServer | None = None


def server() -> ForkServer | None:
    """This process's fork server, started on first use (None if MEMSTUDY_FORKSERVER=0)."""
    global _SERVER
    if not ENABLED:
        return None
    if _SERVER is None or _SERVER.proc.poll() is not None:
        _SERVER = ForkServer()
        atexit.register(_SERVER.close)
    return _SERVER


# -- the server process ---------------------------------------------------------------------
def _warm_imports() -> None:
    """What every cell would import: torch, the model library and the whole harness. Nothing
    here initialises CUDA (checked before each fork)."""
    import torch  # noqa: F401
    import segmentation_models_pytorch  # noqa: F401

    import memstudy.runner  # noqa: F401
    from memstudy.techniques import list_techniques

    list_techniques()  # loads every technique module


FILL_TIMEOUT_S = 600  # workers still filling then are killed: the cells make what is missing


def _fill_caches(data: list[dict], workers: int | None = None) -> int:
    """Every image of each entry's datasets into its on-disk cache, by `workers` forked
    processes (default: one a core) taking every n-th image; returns how many workers ended
    well. A worker that fails leaves its images to the cells, which make them (or report
    what is wrong with the data) as they would without this."""
    if not data:
        return 0
    workers = max(1, min(workers or os.cpu_count() or 1, 64))
    pids = []
    for share in range(workers):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _fill_share(data, share, workers)
                code = 0
            except BaseException:  # noqa: BLE001 - the cell meets the same problem and says it
                pass
            finally:
                os._exit(code)
        pids.append(pid)
    return sum(code == 0 for code in _wait_all(pids, time.time() + FILL_TIMEOUT_S))


def _wait_all(pids: list[int], deadline: float) -> list[int]:
    """The exit codes of `pids`; those still running at `deadline` are killed."""
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes and (done := os.waitpid(pid, os.WNOHANG))[0]:
                codes[pid] = os.waitstatus_to_exitcode(done[1])
        if time.time() > deadline:
            for pid in set(pids) - set(codes):
                os.kill(pid, signal.SIGKILL)
                codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.02)
    return [codes[pid] for pid in pids]


def _fill_share(data: list[dict], share: int, workers: int) -> None:
    """In a worker: the images whose running number is `share` modulo `workers`."""
    from memstudy.config import from_dict
    from memstudy.datasets import build_datasets
    from memstudy.quality import min_side

    number = 0
    for entry in data:
        config = from_dict(entry["config"])
        config.data.cache_dir = config.data.cache_dir or entry["cache"]  # the cells' own folder
        for dataset in build_datasets(config.data, config.train.image_size,
                                      config.train.batch_size, min_side(config.train),
                                      task=config.train.task, classes=config.model.classes):
            for index in range(len(dataset)):
                if number % workers == share:
                    dataset[index]  # made and cached on disk, or already there
                number += 1


def _run_child(request: dict, listener: socket.socket, conns: list[socket.socket]) -> None:
    """In the forked child: the cell's own process group, environment and log, then its
    command line as `python -m` would run it."""
    try:
        os.setpgid(0, 0)  # the cell's own process group (the server sets it too: no race)
        die_with_parent(os.getppid())
        for sock in (listener, *conns):
            sock.close()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(request["env"])
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        flag, module, *args = request["argv"]  # `-m memstudy ...`, as the interpreter gets it
        if flag != "-m":
            raise ValueError(f"the fork server runs `-m module ...` command lines, not {flag!r}")
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # as the interpreter exits: None is 0, a message is printed, 1
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent: int) -> None:
    """In the child, before exec: die with the runner (PR_SET_PDEATHSIG), so killing the
    runner kills its cells and no orphan records a run behind a rerun's back."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the runner died before prctl took effect
            os._exit(1)


def _check_no_cuda() -> None:
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("the fork server initialised CUDA: its children would share a context")


def serve(address: str) -> None:
    # Ctrl-C (or `timeout --signal=INT`) reaches the whole process group: the runner handles
    # it (records what finished, says how to resume) and kills this server; left to Python
    # here it would print a KeyboardInterrupt traceback into the grid's output
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _warm_imports()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    pending: dict[socket.socket, bytes] = {}
    print("ready", flush=True)
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                pending[conn] = b""
                selector.register(conn, selectors.EVENT_READ)
                continue
            conn = key.fileobj
            chunk = conn.recv(65536)
            pending[conn] += chunk
            if not chunk or b"\n" in pending[conn]:
                selector.unregister(conn)
                request = pending.pop(conn)
                if not chunk and b"\n" not in request:
                    conn.close()
                    continue
                request = json.loads(request.split(b"\n", 1)[0])
                if "data" in request:  # the cells' images, made by workers; nothing forked
                    workers_ok = _fill_caches(request["data"])
                    conn.sendall(json.dumps({"workers_ok": workers_ok}).encode() + b"\n")
                    conn.close()
                    continue
                _check_no_cuda()
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    _run_child(request, listener,
                               [*pending, *children.values(), conn])
                try:
                    os.setpgid(pid, pid)
                except OSError:  # the child got there first, or is already gone
                    pass
                children[pid] = conn
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _reap(children)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            code = os.waitstatus_to_exitcode(status)
            try:
                conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
            except OSError:
                pass  # the runner went away
            conn.close()
