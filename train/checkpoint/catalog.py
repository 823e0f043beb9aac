"""Every checkpoint a start may resume from, local and remote, behind one object: the
resume policy (:mod:`.policy`) asks the catalog, never a tier.

Local checkpoints are the run directory's (found and verified by :mod:`.reader`, tidied
and set aside by :mod:`.retention`); remote ones those the store holds
(``checkpoint.remote``: listed by the tier's :class:`~.listing.RemoteListing` and brought
here by its :class:`~.fetcher.Fetcher`). A catalog without a tier (no remote, or a rank
that does not upload) holds only the local ones.
"""

from __future__ import annotations

import logging
from pathlib import Path

from train.checkpoint import reader, retention
from train.checkpoint.reader import CheckpointsUnusable
from train.checkpoint.tier import RemoteTier
from train.core.config import AUTO
from train.core.run import rundir
from train.core.run.rundir import CHECKPOINTS
from train.core.storage.local import LocalStorage
from train.core.storage.s3 import errors, said

log = logging.getLogger("train")


class Catalog:
    """The checkpoints of the run directory ``storage`` and, with ``tier``, the store's."""

    def __init__(self, storage: LocalStorage, tier: RemoteTier | None):
        self.storage, self.tier = storage, tier
        self.dir = storage.path(CHECKPOINTS)

    @property
    def where(self) -> str | None:
        """The store's URL, for messages (None without one)."""
        return self.tier.where if self.tier is not None else None

    def folder(self, step: int) -> Path:
        return self.dir / rundir.step_name(step)

    # ----------------------------------------------------------- local ones
    def holds_any(self) -> bool:
        """Whether the run directory holds a checkpoint (or a node's part of one)."""
        return bool(rundir.candidates(self.dir))

    def remove_leftovers(self, min_age_s: float = 0.0) -> None:
        retention.remove_leftovers(self.storage, min_age_s)

    def set_aside(self) -> None:
        """resume_from=none: the earlier checkpoints moved aside, with a warning."""
        moved = retention.set_aside(self.storage)
        if moved:
            log.warning("checkpoint.resume_from=none: earlier checkpoints moved to %s", moved)

    def set_aside_newer_than(self, step: int) -> None:
        retention.set_aside_newer_than(self.storage, step)

    def pick(self, choice: str) -> tuple[Path | None, tuple | None, str | None]:
        """(path, (shared, mine) loaded for rank 0, problem) for resume_from auto (a
        remote checkpoint newer than every local one is fetched first) or a path."""
        if choice == AUTO:
            if self.tier is not None:
                self.tier.fetcher.fetch_newer()  # a newer one in object storage comes here
            try:
                found = reader.newest_loadable(self.dir, 0)
            except CheckpointsUnusable as exc:  # never a silent start from step 0
                return None, None, str(exc)
            return (found[0], found[1:], None) if found else (None, None, None)
        path = Path(choice)
        problem = reader.verify(path)
        if problem:
            return None, None, f"{choice}: {problem}"
        loaded, problem = reader.load_verified(path, 0)
        return (path, loaded, None) if loaded is not None else (None, None, f"{choice}: {problem}")

    # ---------------------------------------------------------- remote ones
    def remote_steps(self) -> tuple[list[int] | None, str | None]:
        """The remote checkpoints to try, newest first, or why the store cannot say
        (node-local run directories: a resume needs the store)."""
        try:
            return self.tier.listing.sealed_steps(), None
        except errors() as exc:
            return None, (f"cannot read checkpoints from {self.where} ({said(exc)}) and the "
                          "run directories are node-local, so a resume needs the store: "
                          "start the job again when it answers")

    def fetch_part(self, step: int, ranks: list[int]) -> str | None:
        """What every rank of this node reads of the remote ``step`` (:mod:`.fetcher`)."""
        return self.tier.fetcher.fetch_part(step, ranks)

    def fetch_rest(self, step: int, shards: set[str] | None) -> str | None:
        return self.tier.fetcher.fetch_rest(step, shards)

    def drop_fetch(self, step: int) -> None:
        self.tier.fetcher.drop_fetch(step)
