"""One training worker: ``python -m train``'s main, plus a report of how it ended.

torchrun (or the launcher, for a single process) starts ``python -m launcher.worker
CONFIG [overrides]``. This runs the worker in-process and writes
``rank-<RANK>.json`` (exit code, error, log folder) into the launcher's status
folder, so the launcher can map torchrun's result to the user-facing exit codes and
name the failing rank in one line — torchrun alone reports exit 1 with a traceback
for a failure and for SIGTERM alike.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from launcher.environ import worker_identity


class _LastError(logging.Handler):
    """Remembers the last exception the worker logged (it logs, then returns 1)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.error: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            self.error = f"{type(exc).__name__}: {exc}"


def write_status(code: int, error: str | None) -> None:
    ident = worker_identity()
    if not ident.status_dir:
        return
    record = {"rank": ident.rank, "local_rank": ident.local_rank, "restart": ident.restart,
              "exit_code": code, "error": " ".join(error.split())[:500] if error else None,
              "log_dir": ident.log_dir, "pid": os.getpid(), "time": time.time()}
    path = os.path.join(ident.status_dir, f"rank-{ident.rank}.json")
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # reporting must never turn a result into a crash


def main(argv: list[str]) -> int:
    catcher = _LastError()
    logging.getLogger("train").addHandler(catcher)
    code, error = 1, None
    try:
        from train.__main__ import main as train_main
        code = int(train_main(argv) or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        raise
    except BaseException as exc:
        code, error = 1, f"{type(exc).__name__}: {exc}"
        raise
    finally:
        write_status(code, error or (catcher.error if code else None))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
