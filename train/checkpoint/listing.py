"""What the store holds of a run's checkpoints: the remote ``latest``, the step folders
(sealed or not) and, with node-local run directories, each node's part of a checkpoint.

One :class:`RemoteListing` per remote tier (:mod:`.tier`), read by its uploader (which
names ``latest``, prunes and waits for the nodes' parts: :mod:`.uploader`), its fetcher
(which picks what a resume downloads: :mod:`.fetcher`) and the resume's catalog
(:mod:`.catalog`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from train.core.run import rundir
from train.core.run.rundir import CHECKPOINTS, CHECKSUMS, LATEST, STEP_DIR
from train.core.storage.bucket import S3Storage
from train.core.storage.s3 import errors, missing

PARTS = ".parts"                 # a step's node markers (node-local mode)


class RemoteError(Exception):
    """The store did not take (or give back) a checkpoint."""


@dataclass(frozen=True)
class Nodes:
    """Where a tier runs: ``node`` None for a run directory every rank shares; else
    node-local mode, this node's index among ``every`` (each node's, the first rank 0's),
    and how long rank 0's tier waits for the other nodes' parts of a checkpoint."""
    node: int | None = None
    every: tuple[int, ...] = ()
    parts_timeout_s: float = 600.0

    @property
    def publishes(self) -> bool:
        """This tier writes checksums.json, the record and latest (rank 0's)."""
        return self.node is None or self.node == self.every[0]


def part_name(step: int, node: int) -> str:
    return f"{CHECKPOINTS}/{rundir.step_name(step)}/{PARTS}/node-{node}.json"


class RemoteListing:
    """A run's checkpoints in the store (``remote``: the run's key prefix)."""

    def __init__(self, remote: S3Storage, nodes: Nodes):
        self.remote, self.nodes = remote, nodes

    def parts(self, step: int, token: str | None, whole: dict | None) -> dict | None:
        """One look at the nodes' markers of ``step``: the whole checkpoint's checksums
        when every node's part of the save ``token`` is there, or None. A part that
        disagrees (a file two nodes list with other checksums, or not what the ranks
        reported: ``whole``) is a RemoteError: never sealed."""
        merged: dict[str, str] = {}
        for node in self.nodes.every:
            try:
                part = json.loads(self.remote.read(part_name(step, node))[0])
            except errors() as exc:  # re-raised unless it says "not there"
                if missing(exc):
                    return None
                raise
            if part.get("token") != token:  # an earlier save of this step: not yet
                return None
            for name, digest in part["files"].items():
                if merged.setdefault(name, digest) != digest:
                    raise RemoteError(f"two nodes uploaded {name} of step-{step} with "
                                      "different checksums")
        if whole is not None and merged != whole:
            raise RemoteError(f"the nodes' parts of step-{step} in the store do not list the "
                              "files and checksums the ranks wrote")
        return dict(sorted(merged.items()))

    def latest(self) -> tuple[int | None, str | None]:
        """(the step the remote ``latest`` names, its ETag), or (None, None)."""
        try:
            data, etag = self.remote.read(f"{CHECKPOINTS}/{LATEST}")
        except errors() as exc:  # re-raised unless it says "not there"
            if missing(exc):
                return None, None
            raise
        match = STEP_DIR.match(data.decode("utf-8", "replace").strip())
        return (int(match[1]) if match else None), etag

    def steps(self, sealed: bool = False) -> list[int]:
        """The remote step folders, newest first; ``sealed``: only those with their
        checksums.json (some stores list a folder whose objects are all deleted)."""
        found = sorted((int(m[1]) for n in self.remote.names(CHECKPOINTS)
                        if (m := STEP_DIR.match(n))), reverse=True)
        if sealed:
            found = [s for s in found if self.remote.exists(
                f"{CHECKPOINTS}/{rundir.step_name(s)}/{CHECKSUMS}")]
        return found

    def sealed_steps(self) -> list[int]:
        """The remote checkpoints a resume may take, newest first: sealed, up to
        ``latest``. Raises when the store cannot be read."""
        latest, _ = self.latest()
        return [] if latest is None else [s for s in self.steps(sealed=True) if s <= latest]
