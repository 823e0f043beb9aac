"""Which checkpoints a run keeps: the newest ``checkpoint.keep_last`` up to the one
``latest`` names. Nothing else is ever deleted: checkpoints a run cannot or will not
continue from are moved aside whole (``checkpoints.replaced-<time>/`` when a run starts
over, ``checkpoints.abandoned-<time>/`` for steps newer than the one it resumed from),
so no later resume picks them up by accident. Partial checkpoints of a write that died
are removed (never loadable, and they hold disk space).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from train.core import rundir
from train.core.rundir import ABANDONED, CHECKPOINTS, REPLACED, STEP_DIR
from train.core.storage.local import LocalStorage

log = logging.getLogger("train")


def _steps(storage: LocalStorage) -> list[tuple[int, str]]:
    """(step, name) of every sealed step folder, newest first."""
    found = [(int(m[1]), name) for name in storage.names(CHECKPOINTS)
             if (m := STEP_DIR.match(name)) and storage.is_folder(f"{CHECKPOINTS}/{name}")]
    return sorted(found, reverse=True)


def prune(storage: LocalStorage, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints up to ``latest`` (always including it);
    newer ones belong to an abandoned trajectory and are moved aside."""
    latest = rundir.latest_name(storage.path(CHECKPOINTS))
    if latest:
        set_aside_newer_than(storage, rundir.step_of(Path(latest)))
    for _, name in _steps(storage)[keep_last:]:
        storage.delete(f"{CHECKPOINTS}/{name}")
    remove_leftovers(storage)


def remove_leftovers(storage: LocalStorage) -> None:
    """Partial checkpoints of a write that died (kill -9, a full disk) and copies replaced
    by a re-save. Only while no save is in flight (after one, or before the first)."""
    for name in storage.names(CHECKPOINTS):
        if name.startswith("step-") and name.endswith(".partial"):
            storage.delete(f"{CHECKPOINTS}/{name}")
        elif name.startswith("step-") and name.endswith(".replaced"):
            final = f"{CHECKPOINTS}/{name.removesuffix('.replaced')}"
            if storage.exists(final):
                storage.delete(f"{CHECKPOINTS}/{name}")
            else:  # killed between the renames of a seal: the old copy is the checkpoint
                storage.move(f"{CHECKPOINTS}/{name}", final)


def set_aside(storage: LocalStorage) -> Path | None:
    """Starting a run over: its old checkpoints moved out of the way, not deleted. Where
    they went, or None when there were none."""
    if not storage.names(CHECKPOINTS):
        return None
    target = _aside(storage, REPLACED)
    storage.move(CHECKPOINTS, target)
    return storage.path(target)


def set_aside_newer_than(storage: LocalStorage, step: int) -> Path | None:
    """Resuming from ``step`` while newer checkpoints exist (an explicit resume_from, or
    newer ones that did not verify): those moved aside whole."""
    newer = [name for s, name in sorted(_steps(storage)) if s > step]
    if not newer:
        return None
    target = _aside(storage, ABANDONED)
    for name in newer:
        storage.move(f"{CHECKPOINTS}/{name}", f"{target}/{name}")
    log.warning("moved %s (newer than step-%d, which this run continues from) to %s",
                ", ".join(newer), step, storage.path(target))
    return storage.path(target)


def _aside(storage: LocalStorage, why: str) -> str:
    """A new folder name beside checkpoints/ for what is moved out of the way."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    target, n = rundir.aside_name(why, stamp), 1
    while storage.exists(target):
        n += 1
        target = rundir.aside_name(why, f"{stamp}-{n}")
    return target
