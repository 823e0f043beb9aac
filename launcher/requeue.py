"""After a stop for the platform's requeue signal (SLURM's ``#SBATCH --signal``): put
the job back in the queue, so that its next incarnation resumes from the checkpoint
just written.

One task does it (the plan's ``requeue`` command is set on SLURM's task 0 only), after
its workers stopped and its run-directory lease was released: SLURM then ends the
job's remaining processes and starts the job again, keeping its id. A job that cannot
be requeued (submitted without ``--requeue``, or a cluster with ``JobRequeue=0`` and no
flag) is no failure: one line says so, and the exit stays 143 (stopped, resumable).
Inside a container SLURM's commands are not there: the batch script requeues instead.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Callable


def requeue(command: tuple[str, ...], log: Callable[[str], None], timeout_s: float = 60
            ) -> bool:
    """Run the requeue command; True when the job was requeued."""
    if shutil.which(command[0]) is None:  # in a container: SLURM's commands stay outside
        log(f"note: no {command[0]} here (inside a container?): the job's batch script "
            "requeues it, as slurm/train-pyxis.sbatch and slurm/train-apptainer.sbatch do; "
            "otherwise resubmit it: it resumes from the checkpoint just written")
        return False
    try:
        done = subprocess.run(list(command), capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = f"{type(exc).__name__}: {exc}"
    else:
        if done.returncode == 0:
            log(f"requeued the job ({shlex.join(command)}): its next incarnation resumes "
                "from the checkpoint just written")
            return True
        why = " ".join((done.stderr or done.stdout).split()) or f"exit {done.returncode}"
    log(f"warning: the job was not requeued ({shlex.join(command)}: {why}); submit it with "
        "`sbatch --requeue` for it to continue by itself, or resubmit it: it resumes from "
        "the checkpoint just written")
    return False
