"""One training worker: ``python -m train``'s main, plus a report of how it ended.

torchrun (or the launcher, for a single process) starts ``python -m train.worker
CONFIG [overrides]``. This runs the worker in-process and leaves a
:class:`~train.core.run.protocol.Report` (exit code, error, log folder) in the launcher's
status folder, so the launcher can map torchrun's result to the user-facing exit
codes and name the failing rank in one line. Before it trains, it asks the protocol
whether an earlier attempt already ended in a way a restart cannot change.
"""

from __future__ import annotations

import signal
import sys

from train.core.errors import EXIT_TRAINING_FAILED
from train.core.machine.host import die_with_parent, exit_now
from train.core.run import failure_log
from train.core.run.protocol import Reporter


def refused(reporter: Reporter) -> int | None:
    """The exit code of an attempt that must not train at all (torchrun restarts workers
    whatever their exit code), after saying why; None when it may train."""
    rank = reporter.ident.rank
    earlier = reporter.earlier_final()
    if earlier is not None:
        _say(reporter, f"rank {rank}: not restarting: rank {earlier.rank} ended with exit "
                       f"{earlier.exit_code}, which a restart cannot change")
        reporter.ended(earlier.exit_code, earlier.error, earlier.repeated)
        return earlier.exit_code
    again = reporter.repeated_failure()
    if again is not None:
        where = again.checkpoint or "the start (no checkpoint yet)"
        error = (f"{again.error} (the same failure in two attempts in a row, from "
                 f"{where}: a restart cannot fix it, not restarted again)")
        _say(reporter, f"rank {rank}: not restarting: {error}")
        reporter.ended(EXIT_TRAINING_FAILED, error, repeated=again)
        return EXIT_TRAINING_FAILED
    return None


def _say(reporter: Reporter, line: str) -> None:
    """On the console, unless the launcher's last line says it (train.core.run.failure_log)."""
    if failure_log.kept_off_console(reporter.ident, line) is None:
        print(line, file=sys.stderr)


def main(argv: list[str]) -> int:
    # torchrun killed (or the launcher, in direct mode): stop like on SIGTERM, with a
    # checkpoint, instead of training on with no one to report to.
    die_with_parent(signal.SIGTERM)
    reporter = Reporter.from_environ()
    code = refused(reporter)
    if code is not None:
        return code
    code, error = 1, None
    try:
        from train.__main__ import run
        code, error = run(argv, reporter)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        raise
    except BaseException as exc:
        code, error = 1, f"{type(exc).__name__}: {exc}"
        raise
    finally:
        reporter.ended(code, error)
    return code


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
