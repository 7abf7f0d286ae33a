"""Messages to the person at the terminal: progress and notes on stderr, apart from the
results on stdout. `eprint` is a module-level function so that spawned processes can be
handed it (spawn pickles the progress callback by name)."""
from __future__ import annotations

import sys


def eprint(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
