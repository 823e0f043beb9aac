"""Finding and loading a checkpoint: the newest that verifies and loads, with a warning
for each one passed over, and never a silent start from step 0 when checkpoints exist
but none can be resumed (:class:`CheckpointsUnusable`).

Verifying reads every file back against ``checksums.json``; files load with
``torch.load(weights_only=True)``, so a checkpoint cannot run code.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from train.core.files import describe_load_error
from train.core.run import rundir
from train.core.run.rundir import CHECKSUMS, STATE_FILE
from train.core.storage.local import LocalStorage

log = logging.getLogger("train")


class CheckpointsUnusable(Exception):
    """Checkpoints exist and none of them can be resumed."""


def verify(path: Path) -> str | None:
    """None when every file of the checkpoint ``path`` matches its checksums.json,
    else what is wrong."""
    problem = rundir.quick_check(path)
    if problem:
        return problem
    folder = LocalStorage(path)
    for name, digest in json.loads(folder.read_text(CHECKSUMS)).items():
        if folder.digest(name) != digest:
            return f"{name} does not match its checksum"
    return None


def load(path: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(state.pt, this rank's rank-<r>.pt or None) of the checkpoint ``path``."""
    import torch
    shared = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    own = path / rundir.rank_file(rank)
    mine = torch.load(own, map_location="cpu", weights_only=True) if own.exists() else None
    return shared, mine


def load_verified(path: Path, rank: int) -> tuple[tuple[dict, dict | None] | None, str | None]:
    """:func:`load` of a checkpoint that verified, or why torch cannot read it back."""
    try:
        return load(path, rank), None
    except Exception as exc:  # verified bytes torch cannot read back: torch.load raises
        # unrelated types for them (UnpicklingError, RuntimeError, EOFError, ...), and any
        # of them means this checkpoint cannot be resumed
        return None, f"cannot be loaded: {describe_load_error(exc)}"


def newest_loadable(folder: Path, rank: int = 0) -> tuple[Path, dict, dict | None] | None:
    """The newest checkpoint of ``folder`` (a run's checkpoints/) that verifies and loads,
    loaded. None when there are none; CheckpointsUnusable when none verifies and loads."""
    found, problems = rundir.candidates(folder), []
    for path in found:
        problem = verify(path)
        if problem is None:
            loaded, problem = load_verified(path, rank)
            if loaded is not None:
                return (path, *loaded)
        log.warning("checkpoint %s is unusable (%s); trying the previous one", path, problem)
        problems.append((path.name, problem))
    if found:
        raise CheckpointsUnusable(rundir.none_usable(folder, problems))
    return None
