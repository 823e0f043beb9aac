"""A rank that failed because another died: how its error is recognised and said.

When one rank dies (killed by a signal, out of memory, its node lost), every other rank
fails in its next collective with the communication library's words for a closed
connection, often under a long traceback. Those ranks are survivors, not the cause: the
launcher names the rank that died (:mod:`launcher.outcome`), and a survivor says one
short line on the console and keeps its traceback in its own log folder
(:func:`keep_traceback`), out of the console torchrun tees every rank's output to.
"""

from __future__ import annotations

import re
import sys
import traceback
from pathlib import Path

from train.core.credentials import redacted

# gloo's words for a peer that died (its process, or its whole node), both forms; NCCL's.
_WITH_ADDRESS = (re.compile(r"\[([^\]]+)\]:(\d+): Connection (?:reset|closed) by peer"),
                 re.compile(r"Connection (?:reset|closed) by peer \[([^\]]+)\]:(\d+)"))
_NCCL = re.compile(r"remote process exited or there was a network error", re.IGNORECASE)
# Where a survivor keeps its traceback: beside torchrun's stderr.log of the rank.
TRACEBACK = "traceback.log"


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


def keep_traceback(log_dir: str | None) -> Path | None:
    """Write the exception being handled, its traceback with credentials hidden, to
    ``log_dir``/traceback.log; None (nothing written) without a log folder or when it
    cannot be written: the caller then prints it as before."""
    if not log_dir:
        return None
    path = Path(log_dir) / TRACEBACK
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(redacted(traceback.format_exc()))
    except OSError:
        return None
    return path


def survived(rank: int, error: str, log_dir: str | None) -> bool:
    """Inside an ``except``: when ``error`` says another rank died, keep the traceback in
    ``log_dir`` and print one line instead; False (nothing done) for any other error, or
    without a log folder (the caller then shows its traceback as usual)."""
    lost = lost_peer(error)
    kept = keep_traceback(log_dir) if lost else None
    if kept is None:
        return False
    print(f"rank {rank}: {lost} (it died, or its node did); stopping (traceback in {kept})",
          file=sys.stderr, flush=True)
    return True
