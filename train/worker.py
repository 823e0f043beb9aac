"""One training worker: ``python -m train``'s main, plus a report of how it ended.

torchrun (or the launcher, for a single process) starts ``python -m train.worker
CONFIG [overrides]``. This runs the worker in-process and leaves a
:class:`~train.core.reports.Report` (exit code, error, log folder) in the launcher's
status folder, so the launcher can map torchrun's result to the user-facing exit
codes and name the failing rank in one line.
"""

from __future__ import annotations

import signal
import sys

from train.core import reports
from train.core.errors import FINAL_EXIT_CODES
from train.core.host import die_with_parent
from train.core.identity import WorkerIdentity


def write_status(code: int, error: str | None, env: WorkerIdentity | None = None) -> None:
    env = env or WorkerIdentity.from_environ()
    reports.write(env.status_dir, reports.Report(
        rank=env.rank, local_rank=env.local_rank, restart=env.restart_count, exit_code=code,
        error=error, log_dir=env.log_dir))


def final_failure(env: WorkerIdentity) -> reports.Report | None:
    """An earlier round's report of a failure a restart cannot change (bad input, this
    machine cannot run it, divergence, a full disk), or None. torchrun restarts workers
    whatever their exit code; such a restart ends at once with the same answer."""
    if env.restart_count == 0 or not env.status_dir:
        return None
    return next((r for r in reports.read_all(env.status_dir)
                 if r.restart < env.restart_count and r.exit_code in FINAL_EXIT_CODES), None)


def main(argv: list[str]) -> int:
    # torchrun killed (or the launcher, in direct mode): stop like on SIGTERM, with a
    # checkpoint, instead of training on with no one to report to.
    die_with_parent(signal.SIGTERM)
    code, error = 1, None
    env = WorkerIdentity.from_environ()
    earlier = final_failure(env)
    if earlier is not None:
        print(f"rank {env.rank}: not restarting: rank {earlier.rank} ended with exit "
              f"{earlier.exit_code}, which a restart cannot change", file=sys.stderr)
        write_status(earlier.exit_code, earlier.error, env)
        return earlier.exit_code
    try:
        from train.__main__ import run
        code, error = run(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        raise
    except BaseException as exc:
        code, error = 1, f"{type(exc).__name__}: {exc}"
        raise
    finally:
        write_status(code, error)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
