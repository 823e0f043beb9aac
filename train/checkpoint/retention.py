"""Which checkpoints a run keeps: the newest ``checkpoint.keep_last`` up to the one
``latest`` names. Nothing else is ever deleted: checkpoints a run cannot or will not
continue from are moved aside whole (``checkpoints.replaced-<time>/`` when a run starts
over, ``checkpoints.abandoned-<time>/`` for steps newer than the one it resumed from),
so no later resume picks them up by accident. Partial checkpoints of a write that died
are removed (never loadable, and they hold disk space).

Deleting a checkpoint's files takes the file system a few milliseconds per file (freeing
its blocks), time a save would otherwise block training for: a pruned checkpoint is
renamed ``step-N.pruned`` (one rename: no resume can pick it up from then on) and
deleted by a thread, which the next prune and :func:`settle` wait for. One a process
did not finish (killed) is removed with the partial ones at the next start.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from train.core.run import rundir
from train.core.run.rundir import ABANDONED, CHECKPOINTS, REPLACED, STEP_DIR
from train.core.storage.local import LocalStorage

log = logging.getLogger("train")

PRUNED = ".pruned"  # step-N.pruned: a checkpoint being deleted
_deleting: dict[Path, threading.Thread] = {}  # checkpoints folder -> its deleting thread


def _steps(storage: LocalStorage) -> list[tuple[int, str]]:
    """(step, name) of every sealed step folder, newest first."""
    found = [(int(m[1]), name) for name in storage.names(CHECKPOINTS)
             if (m := STEP_DIR.match(name)) and storage.is_folder(f"{CHECKPOINTS}/{name}")]
    return sorted(found, reverse=True)


def prune(storage: LocalStorage, keep_last: int, leftovers_age_s: float = 0.0) -> None:
    """Keep the newest ``keep_last`` checkpoints up to ``latest`` (always including it);
    newer ones belong to an abandoned trajectory and are moved aside. Runs after a
    checkpoint is sealed, so a failure here (the disk turned read-only a moment after
    the seal) costs only disk space: it is logged, and the next save reports the disk."""
    try:
        _prune(storage, keep_last, leftovers_age_s)
    except OSError as exc:
        log.warning("could not remove old checkpoints from %s (%s); they stay until a "
                    "later save can", storage.path(CHECKPOINTS), exc.strerror or exc)


def _prune(storage: LocalStorage, keep_last: int, leftovers_age_s: float) -> None:
    latest = rundir.latest_name(storage.path(CHECKPOINTS))
    if latest:
        set_aside_newer_than(storage, rundir.step_of(Path(latest)))
    remove_leftovers(storage, leftovers_age_s)
    doomed = []
    for _, name in _steps(storage)[keep_last:]:
        doomed.append(f"{CHECKPOINTS}/{name}{PRUNED}")
        # not durable on purpose: if the rename is lost, the next prune takes it again
        os.replace(storage.path(f"{CHECKPOINTS}/{name}"), storage.path(doomed[-1]))
    if doomed:
        thread = threading.Thread(target=_delete, args=(storage, doomed), daemon=True,
                                  name="checkpoint-prune")
        _deleting[storage.path(CHECKPOINTS)] = thread
        thread.start()


def settle(storage: LocalStorage) -> None:
    """Wait until the checkpoints this process pruned are deleted (before it ends, and
    before anything else removes or lists what the folder holds)."""
    thread = _deleting.pop(storage.path(CHECKPOINTS), None)
    if thread is not None:
        thread.join()


def _delete(storage: LocalStorage, names: list[str]) -> None:
    try:
        for name in names:
            storage.delete(name)
    except OSError as exc:  # renamed already: no resume picks it up, the next start
        # removes it
        log.warning("could not delete the pruned %s (%s)", name, exc.strerror or exc)


def remove_leftovers(storage: LocalStorage, min_age_s: float = 0.0) -> None:
    """Partial checkpoints of a write that died (kill -9, a full disk), copies replaced
    by a re-save and pruned ones a killed process did not delete. Only while no save is
    in flight (after one, or before the first). ``min_age_s``: only those unchanged for
    that long (replica groups share the folder: another live group may be writing one
    now, and it would fail if its partial vanished)."""
    settle(storage)
    for name in storage.names(CHECKPOINTS):
        if min_age_s and _age(storage.path(f"{CHECKPOINTS}/{name}")) < min_age_s:
            continue
        if name.startswith("step-") and name.endswith((".partial", PRUNED)):
            storage.delete(f"{CHECKPOINTS}/{name}")
        elif name.startswith("step-") and name.endswith(".replaced"):
            final = f"{CHECKPOINTS}/{name.removesuffix('.replaced')}"
            if storage.exists(final):
                storage.delete(f"{CHECKPOINTS}/{name}")
            else:  # killed between the renames of a seal: the old copy is the checkpoint
                storage.move(f"{CHECKPOINTS}/{name}", final)


def _age(path: Path) -> float:
    """Seconds since ``path`` or anything directly in it last changed."""
    try:
        newest = max([path.stat().st_mtime] + [p.stat().st_mtime for p in path.iterdir()]
                     if path.is_dir() else [path.stat().st_mtime])
    except OSError:
        return 0.0  # changing now
    return time.time() - newest


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
