"""A finished run's final checkpoint that never reached ``checkpoint.remote``, uploaded by
the next start.

The end of a run waits for the last upload only within ``train.shutdown_timeout_s``
(a store that hangs must not hold a finished job, nor make torchrun restart it). When
the final checkpoint is still only on the run's disk then, the run ends with
:data:`~train.core.errors.EXIT_ONLY_LOCAL` (a code a Job or a SLURM requeue retries),
and the next start on the same disk, finding the run finished, comes here instead of
saying "nothing to do": the newest sealed local checkpoint is uploaded and named
``latest`` in the store exactly as the run's own uploader does it (:mod:`.uploader`),
and the start exits 0. A store still unreachable is the same exit code again.

Bounded by ``distributed.timeout_s``: this start has nothing else to do, and a large
checkpoint may need longer than the end of a run may wait. The launcher (which imports
nothing of train but its core) runs it as ``python -m train.checkpoint.left_behind URL
RUN_DIR RUN_NAME KEEP_LAST TIMEOUT_S``; a bare worker calls :func:`upload_left_behind`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from train.checkpoint.tier import tier_for
from train.core.config import Config
from train.core.errors import EXIT_OK, EXIT_ONLY_LOCAL
from train.core.run import rundir
from train.core.storage.s3 import errors, said


def print_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Run:
    """What the upload needs of a run's config."""
    remote: str | None       # checkpoint.remote
    run_dir: Path
    name: str                # run.name
    keep_last: int           # checkpoint.keep_last
    timeout_s: float         # distributed.timeout_s

    @classmethod
    def of(cls, cfg: Config) -> Run:
        return cls(cfg.checkpoint.remote, cfg.run_dir, str(cfg.run.name),
                   cfg.checkpoint.keep_last, cfg.distributed.timeout_s)


def upload_left_behind(run: Run, say: Callable[[str], None] = print_line) -> int:
    """Upload the newest local checkpoint of a finished run when the store's ``latest``
    is older; the exit code of this start (0, or EXIT_ONLY_LOCAL with one line said)."""
    tier = tier_for(run.remote, run.run_dir, run.name, run.keep_last)
    folder = run.run_dir / rundir.CHECKPOINTS
    local = [p for p in rundir.candidates(folder) if rundir.quick_check(p) is None]
    if tier is None or not local:
        return EXIT_OK  # node-local parts are uploaded by their nodes' run, not here
    step = rundir.step_of(local[0])
    try:
        stored, _ = tier.listing.latest()
    except errors() as exc:  # the store's or the network's answer, said in one line
        say(only_local_line(step, tier.where, f"the store did not answer ({said(exc)})"))
        return EXIT_ONLY_LOCAL
    if stored is not None and stored >= step:
        return EXIT_OK
    say(f"checkpoint {rundir.step_name(step)} of the finished run is only local: uploading "
        f"it to {tier.where}")
    tier.uploader.sealed(step)
    if tier.uploader.wait(run.timeout_s, warn=False) is not None or \
            tier.uploader.uploaded != step:
        say(only_local_line(step, tier.where, f"its upload did not finish within "
                                              f"distributed.timeout_s={run.timeout_s:g}"))
        return EXIT_ONLY_LOCAL
    say(f"checkpoint {rundir.step_name(step)} is in {tier.where} and named latest there")
    return EXIT_OK


def only_local_line(step: int, where: str, why: str) -> str:
    """The one line of a run whose final checkpoint is only on its disk."""
    return (f"error: the run finished, but its final checkpoint {rundir.step_name(step)} is "
            f"only on this disk: {why} ({where}); run the same command again with the same "
            "run directory once the store answers, and it uploads it")


if __name__ == "__main__":
    url, folder, name, keep, timeout = sys.argv[1:6]
    sys.exit(upload_left_behind(Run(url, Path(folder), name, int(keep), float(timeout))))

