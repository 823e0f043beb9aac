"""A rank's failure, said once on the console.

Under the launcher with more than one process, torchrun tees every rank's output to one
console (``--tee 3``), and the launcher ends the run with one line naming the rank that
failed first, its error and where its details are (:mod:`launcher.endings.outcome`). A line of
each rank's own on top of it (every rank meets the same config error; a rank that only
lost its connection to the one that died; one that torchrun stopped because another
failed) says the same thing several times over, above the line that matters.

So there, a rank keeps its failure in its own log folder, beside torchrun's
``stderr.log``: ``traceback.log`` gets the traceback (when there is one: an unexpected
error, or the exception your own code raised under a config error) and the one-line
error; the console gets nothing of it, and the launcher names that file. Run any other
way (one process, ``python -m train``, plain torchrun: no launcher sums up) a rank says
its failure on its stderr as before.
"""

from __future__ import annotations

import traceback
from pathlib import Path

from train.core.run.identity import WorkerIdentity
from train.core.storage.credentials import redacted

# Beside torchrun's stdout.log and stderr.log of the rank, which it does not tee.
TRACEBACK = "traceback.log"
# In the launcher's status folder while torchrun's agent stops the other processes of an
# attempt in which one failed (launcher.torchrun): their stop signal is not the job's.
STOPPING_AFTER_FAILURE = "stopping-after-failure"


def summed_up(ident: WorkerIdentity) -> bool:
    """The launcher reads this rank's report and torchrun keeps a log folder for it: the
    launcher's last line says the failure, naming the folder."""
    return bool(ident.status_dir and ident.log_dir)


def keep(log_dir: str | None, line: str | None = None,
         error: BaseException | None = None) -> Path | None:
    """Append ``error``'s traceback (when given) and ``line`` to ``log_dir``/traceback.log,
    credentials hidden; None (nothing written) without a log folder or when it cannot be
    written: the caller then prints them as before."""
    if not log_dir:
        return None
    path = Path(log_dir) / TRACEBACK
    trace = "".join(traceback.format_exception(error)) if error is not None else ""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(redacted(trace + (f"{line}\n" if line else "")))
    except OSError:
        return None
    return path


def kept_off_console(ident: WorkerIdentity, line: str,
                     error: BaseException | None = None) -> Path | None:
    """Where this rank's failure went instead of the console (see the module docstring);
    None: nobody sums up (or the file cannot be written), the caller prints it."""
    return keep(ident.log_dir, line, error) if summed_up(ident) else None


def stopped_for_another(ident: WorkerIdentity) -> bool:
    """torchrun is stopping this rank because another process of its attempt failed: its
    agent said so before it sent the stop signal (:mod:`launcher.torchrun`). A stop of
    the whole job (Ctrl-C, the platform's SIGTERM) is not such a stop."""
    return summed_up(ident) and stopping_after_failure(ident.status_dir)


def stopping_after_failure(folder: str | Path | None, now: bool | None = None) -> bool:
    """Whether torchrun is stopping an attempt's processes because one failed; ``now``:
    say it starts (True) or is over (False)."""
    if not folder:
        return False
    path = Path(folder) / STOPPING_AFTER_FAILURE
    try:
        if now:
            path.touch()
        elif now is False:
            path.unlink(missing_ok=True)
    except OSError:
        pass  # saying it must never turn a result into a crash
    return path.exists()


def kept_stop(line: str) -> bool:
    """A stop signal's ``line``, kept in this rank's log folder when torchrun stops it
    because another process failed (:func:`stopped_for_another`); False: say it."""
    ident = WorkerIdentity.from_environ()
    return stopped_for_another(ident) and keep(ident.log_dir, line) is not None
