"""A rank that failed because another died: how its error is recognised and said.

When one rank dies (killed by a signal, out of memory, its node lost), every other rank
fails in its next collective with the communication library's words for a closed
connection, often under a long traceback. Those ranks are survivors, not the cause: the
launcher names the rank that died (:mod:`launcher.endings.outcome`), and a survivor keeps its
traceback in its own log folder (:func:`train.core.run.failure_log.keep`), out of the console
torchrun tees every rank's output to, with at most one short line on the console.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from train.core.run import failure_log

# gloo's words for a peer that died (its process, or its whole node), both forms; NCCL's.
_WITH_ADDRESS = (re.compile(r"\[([^\]]+)\]:(\d+): Connection (?:reset|closed) by peer"),
                 re.compile(r"Connection (?:reset|closed) by peer \[([^\]]+)\]:(\d+)"))
_NCCL = re.compile(r"remote process exited or there was a network error", re.IGNORECASE)


def lost_peer(error: str) -> str | None:
    """A short line for "a peer died" errors, which otherwise run to several lines; None
    for any other error."""
    for pattern in _WITH_ADDRESS:
        m = pattern.search(error)
        if m:
            return f"lost the connection to the worker at {m[1]}:{m[2]}"
    if _NCCL.search(error):
        return ("lost the connection to another rank (NCCL: remote process exited or there "
                "was a network error)")
    return None


def survived(rank: int, error: str, log_dir: str | None, quiet: bool = False) -> Path | None:
    """Inside an ``except``: when ``error`` says another rank died, keep the traceback in
    ``log_dir`` and print one line instead (``quiet``: the launcher sums up, so the line
    goes to the file too: :mod:`train.core.run.failure_log`). The file; None (nothing done)
    for any other error, or without a log folder (the caller then shows its traceback as
    usual)."""
    lost = lost_peer(error)
    line = f"rank {rank}: {lost} (it died, or its node did); stopping"
    kept = failure_log.keep(log_dir, line if quiet else None, sys.exc_info()[1]) \
        if lost else None
    if kept is not None and not quiet:
        print(f"{line} (traceback in {kept})", file=sys.stderr, flush=True)
    return kept
