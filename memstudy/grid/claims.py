"""Claims: any number of grid runners on one database run each cell once.

Before a runner starts a cell it claims the cell's config hash in the database's `claims`
table, in one write transaction (BEGIN IMMEDIATE) that also looks at the recorded runs: so of
two runners reaching the same cell, exactly one sees it free, and a cell whose run was recorded
in the meantime is never claimed again. The claim is released when the cell ends (recorded,
killed or crashed): the child records its run before the runner releases the claim, so another
runner always finds one or the other.

A runner that dies (SIGKILL, a lost node) cannot release its claims. A claim is taken over as
stale when its runner's process is gone (same host: the pid no longer exists) or when its
heartbeat, refreshed every HEARTBEAT_S by the runner while the cell runs, is older than
STALE_S (any host; it also covers a reused pid). The trade-off: a runner frozen for longer
than STALE_S loses its cells to another, which is why STALE_S is many heartbeats long.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from memstudy.store import ResultsDB

HEARTBEAT_S = 10.0
STALE_S = 300.0
# attempt kinds --retry accepts: a recorded status, or 'timeout' (status error, phase timeout)
RETRY_KINDS = ("error", "oom", "diverged", "timeout")


@dataclass(frozen=True)
class Runner:
    host: str
    pid: int
    started: float  # attempts that ended before this runner started may be retried by it

    @classmethod
    def this_process(cls) -> "Runner":
        return cls(socket.gethostname(), os.getpid(), time.time())

    def __str__(self) -> str:
        return f"{self.host} pid {self.pid}"


@dataclass(frozen=True)
class Holder:
    """Who has a cell: another runner's live claim."""
    host: str
    pid: int
    claimed_at: float

    def __str__(self) -> str:
        return (f"claimed by the runner {self.host} pid {self.pid} since "
                f"{time.strftime('%H:%M:%S', time.localtime(self.claimed_at))}")


def attempt_kind(status: str, failed_phase: str | None) -> str:
    return "timeout" if status == "error" and failed_phase == "timeout" else status


def parse_retry(text: str | None) -> frozenset[str]:
    """'error,oom,timeout' -> the attempt kinds to run again; unknown kinds are refused."""
    from memstudy.errors import ConfigError

    kinds = frozenset(k.strip() for k in (text or "").split(",") if k.strip())
    unknown = sorted(kinds - set(RETRY_KINDS))
    if unknown:
        raise ConfigError(f"--retry {','.join(unknown)}: not an attempt kind; give a "
                          f"comma-separated list of {', '.join(RETRY_KINDS)}")
    return kinds


def latest_attempts(db: ResultsDB) -> dict[str, dict]:
    """The last recorded run of every config hash: {hash: {id, status, failed_phase, finished_at}}."""
    rows = db.query("SELECT id, config_hash, status, failed_phase, finished_at FROM runs "
                    "ORDER BY id")
    return {r["config_hash"]: r for r in rows}


def wants_rerun(attempt: dict | None, retry: frozenset[str], runner: Runner) -> bool:
    """No attempt yet, or one of a kind to retry that ended before this runner started (an
    attempt made meanwhile by another runner with the same --retry is not repeated)."""
    if attempt is None:
        return True
    kind = attempt_kind(attempt["status"], attempt["failed_phase"])
    return kind in retry and attempt["finished_at"] < runner.started


def claim(db: ResultsDB, key: str, runner: Runner, retry: frozenset[str] = frozenset(),
          now: float | None = None) -> Holder | dict | None:
    """Claim the cell `key` for `runner`. Returns None when claimed, the recorded attempt (a
    dict) when it needs no run, or the Holder of another runner's live claim."""
    now = time.time() if now is None else now
    with db.transaction(immediate=True) as con:
        last = con.execute("SELECT id, status, failed_phase, finished_at FROM runs WHERE "
                           "config_hash = ? ORDER BY id DESC LIMIT 1", (key,)).fetchone()
        if last is not None and not wants_rerun(dict(last), retry, runner):
            return dict(last)
        held = con.execute("SELECT host, pid, claimed_at, heartbeat FROM claims WHERE "
                           "config_hash = ?", (key,)).fetchone()
        if held is not None and not _stale(held, runner, now):
            return Holder(held["host"], held["pid"], held["claimed_at"])
        con.execute("INSERT OR REPLACE INTO claims VALUES (?,?,?,?,?)",
                    (key, runner.host, runner.pid, now, now))
    return None


def release(db: ResultsDB, keys: list[str], runner: Runner) -> None:
    """Drop this runner's claims on `keys` (a claim taken over by another stays theirs)."""
    with db.transaction() as con:
        con.executemany("DELETE FROM claims WHERE config_hash = ? AND host = ? AND pid = ?",
                        [(k, runner.host, runner.pid) for k in keys])


def heartbeat(db: ResultsDB, keys: list[str], runner: Runner) -> None:
    with db.transaction() as con:
        con.executemany("UPDATE claims SET heartbeat = ? WHERE config_hash = ? AND host = ? "
                        "AND pid = ?", [(time.time(), k, runner.host, runner.pid) for k in keys])


def _stale(held, runner: Runner, now: float) -> bool:
    if now - held["heartbeat"] > STALE_S:
        return True
    return held["host"] == runner.host and not _alive(held["pid"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:  # a zombie (dead, not yet reaped by its parent) holds nothing
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
