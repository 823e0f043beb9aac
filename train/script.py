"""The user's own script under the launcher: ``python -m train.script SCRIPT [args]`` or
``python -m train.script -m MODULE [args]``.

torchrun (or the launcher, for one process) starts this in place of the trainer for
``entrypoint.py launch``. It runs the script as ``__main__`` (as ``python SCRIPT`` would:
``sys.argv``, ``sys.path[0]``), and leaves a :class:`~train.core.run.protocol.Report` of how it
ended, so the launcher can name the failing rank in one line and map the exit codes as
for training. Like a training worker, it stops when its parent (torchrun or the
launcher) dies.

It ends the way the trainer does, without the interpreter's finalisation
(:func:`train.core.machine.host.exit_now`): there, the destructors of a gloo process group's C++
threads now and then abort a rank that has finished ("terminate called without an active
exception"), which read as a failed run. What a script may rely on from a normal exit
still happens first, in Python's order: its non-daemon threads are joined, then its
``atexit`` functions run; only objects' finalisers at teardown (which Python never
promises) are skipped.
"""

from __future__ import annotations

import atexit
import runpy
import signal
import sys
import threading
import traceback
from pathlib import Path

from train.core.machine.host import die_with_parent, exit_now
from train.core.run import peers
from train.core.run.identity import WorkerIdentity
from train.core.run.protocol import Reporter


def run(argv: list[str]) -> tuple[int, str | None]:
    """(exit code, one-line error) of the script."""
    if not argv:
        return 2, "error: command line: launch: no script given"
    module = argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    sys.argv = [target, *args]
    if not module:
        sys.path.insert(0, str(Path(target).resolve().parent))
    # the script's store servers (its init_process_group) listen where MASTER_ADDR says
    from train.distributed.stores import bind_store_servers
    bind_store_servers()
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        message = None if code == 0 or isinstance(exc.code, int) else str(exc.code)
        if message:
            print(message, file=sys.stderr)
        return code, message
    except BaseException as exc:  # the traceback is the script's business: show it
        error = f"{type(exc).__name__}: {exc}"
        ident = WorkerIdentity.from_environ()
        if not peers.survived(ident.rank, error, ident.log_dir):  # another rank died
            traceback.print_exc()
        return 1, error
    return 0, None


def finish_like_python() -> None:
    """What the interpreter does at a normal exit before it tears objects down: wait for
    the script's non-daemon threads, then run its atexit functions."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()


def main(argv: list[str]) -> int:
    die_with_parent(signal.SIGTERM)
    code, error = 1, None
    try:
        code, error = run(argv)
        finish_like_python()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        Reporter.from_environ().ended(code, error)
    return code


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
