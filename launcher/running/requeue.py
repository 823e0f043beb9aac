"""After a stop for the platform's requeue signal (SLURM's ``#SBATCH --signal``): put
the job back in the queue, so that its next incarnation resumes from the checkpoint
just written.

One task does it (the plan's ``requeue`` command is set on SLURM's task 0 only), after
its workers stopped and its run-directory lease was released: SLURM then ends the
job's remaining processes and starts the job again, keeping its id. A job that cannot
be requeued (submitted without ``--requeue``, or a cluster with ``JobRequeue=0`` and no
flag) is no failure: one line says so, and the exit stays 143 (stopped, resumable).
Inside a container SLURM's commands are not there: the batch script requeues instead.

After the preflight check found nodes unfit (``distributed.preflight: fail``, exit 3),
:func:`requeue_without` puts the job back in the queue without them. A running job's
excluded nodes cannot be changed (``Job is no longer pending execution``), so: hold it
in the queue (``scontrol requeuehold``: SLURM stops the job's processes, this one
ignores the SIGTERM that brings for the moment it needs), add the nodes to its
``ExcNodeList``, release it. The next incarnation starts once other nodes are free.
"""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable


def requeue(command: tuple[str, ...], log: Callable[[str], None], timeout_s: float = 60
            ) -> bool:
    """Run the requeue command; True when the job was requeued."""
    if shutil.which(command[0]) is None:  # in a container: SLURM's commands stay outside
        log(f"note: no {command[0]} here (inside a container?): the job's batch script "
            "requeues it, as slurm/train-pyxis.sbatch and slurm/train-apptainer.sbatch do; "
            "otherwise resubmit it: it resumes from the checkpoint just written")
        return False
    # said before: once SLURM takes the request it ends this step, this process included,
    # often before the command returns; a failure is a second line
    log(f"requeueing the job ({shlex.join(command)}): its next incarnation resumes from the "
        "checkpoint just written")
    try:
        done = subprocess.run(list(command), capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = f"{type(exc).__name__}: {exc}"
    else:
        if done.returncode == 0:
            return True
        why = " ".join((done.stderr or done.stdout).split()) or f"exit {done.returncode}"
    log(f"warning: the job was not requeued ({shlex.join(command)}: {why}); submit it with "
        "`sbatch --requeue` for it to continue by itself, or resubmit it: it resumes from "
        "the checkpoint just written")
    return False


def requeue_without(command: tuple[str, ...], hosts: tuple[str, ...],
                    log: Callable[[str], None], timeout_s: float = 30) -> bool:
    """Requeue the job of ``command`` (``scontrol requeue JOB``) excluding ``hosts``;
    True when its next incarnation will run without them."""
    scontrol, job = command[0], command[-1]
    names = ",".join(hosts)
    if shutil.which(scontrol) is None:
        log(f"note: no {scontrol} here (inside a container?): resubmit the job with "
            f"`sbatch --exclude={names}`")
        return False
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # requeuehold sends one
    try:
        def run(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([scontrol, *args], capture_output=True, text=True,
                                  timeout=timeout_s)
        excluded = re.search(r"\bExcNodeList=(\S+)", run("-o", "show", "job", job).stdout)
        keep = [] if excluded is None or excluded[1] == "(null)" else [excluded[1]]
        steps = (("requeuehold", job),
                 ("update", f"JobId={job}", f"ExcNodeList={','.join([*keep, names])}"),
                 ("release", job))
        for args in steps:
            done = run(*args)
            if done.returncode:
                why = " ".join((done.stderr or done.stdout).split()) or f"exit {done.returncode}"
                log(f"warning: could not requeue the job without {names} (scontrol "
                    f"{' '.join(args)}: {why}); resubmit it with `sbatch --exclude={names}`")
                if args[0] != "requeuehold":
                    run("release", job)  # held, it would wait for someone forever
                return False
        _released(run, job)
        log(f"requeued the job without {names} (scontrol requeuehold, update "
            f"ExcNodeList, release): its next incarnation starts on other nodes")
        return True
    except (OSError, subprocess.TimeoutExpired) as exc:
        log(f"warning: could not requeue the job without {names} ({type(exc).__name__}: "
            f"{exc}); resubmit it with `sbatch --exclude={names}`")
        return False
    finally:
        signal.signal(signal.SIGTERM, previous)


def _released(run: Callable[..., subprocess.CompletedProcess], job: str) -> None:
    """A release that came before SLURM finished the hold leaves it held: again, a few
    times, until the job no longer waits for one."""
    for _ in range(20):
        shown = run("-o", "show", "job", job).stdout
        if "held" not in (re.search(r"\bReason=(\S+)", shown) or ["", ""])[1]:
            return
        run("release", job)
        time.sleep(0.5)
