"""The remote tier's fetcher: a remote checkpoint brought into the run directory when a
start resumes from it, downloaded into ``step-N.partial``, every file checked against the
checksums.json it arrives with, then sealed locally like a fresh save (:mod:`.store`'s
protocol); an empty run directory also gets the record a resumed run continues
(metrics.jsonl and manifest.json).

A run directory the ranks share fetches a checkpoint whole (:meth:`Fetcher.fetch_newer`,
rank 0, before the local choice). Node-local run directories fetch on every node what its
ranks read of the chosen checkpoint (:meth:`Fetcher.fetch_part`, then
:meth:`Fetcher.fetch_rest` with the shard files the ranks name: the files a node already
holds with the right checksum are kept, not downloaded again), marked as that node's part.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from train.checkpoint.listing import Nodes, RemoteListing
from train.core.run import rundir
from train.core.run.rundir import (
    CHECKPOINTS,
    CHECKSUMS,
    LATEST,
    MANIFEST,
    METRICS,
    NODE_PART,
    SHARDS,
)
from train.core.storage.bucket import S3Storage
from train.core.storage.local import LocalStorage
from train.core.storage.s3 import errors, missing, said

log = logging.getLogger("train")

CONTINUED = (METRICS, MANIFEST)  # the record files a resumed run appends to
SHARDS_INDEX = ".metadata"       # DCP's index of a sharded checkpoint, in SHARDS/
RANK_FILE = re.compile(r"^rank-(\d+)\.pt$")  # rundir.rank_file's names


def _failures() -> tuple[type[BaseException], ...]:
    """What a fetch can meet: the store's or the network's no, a local file's, and a
    checksums.json that is not JSON (a ValueError)."""
    return (*errors(), ValueError)


class Fetcher:
    """Brings remote checkpoints of ``remote`` (listed by ``listing``) into the run
    directory ``local``; ``where``: the store's URL, for messages."""

    def __init__(self, remote: S3Storage, local: LocalStorage, listing: RemoteListing,
                 where: str, nodes: Nodes):
        self.remote, self.local, self.listing = remote, local, listing
        self.where, self.nodes = where, nodes

    def fetch_newer(self) -> int | None:
        """Rank 0, before choosing a checkpoint: the newest remote checkpoint (up to the
        remote ``latest``) newer than every local one, downloaded, verified and sealed
        locally. The step fetched, or None (none newer, or the store unreachable: a
        warning, and the local checkpoints are used)."""
        try:
            latest, _ = self.listing.latest()
            if latest is None:
                return None
            local = max((rundir.step_of(p) for p in rundir.step_dirs(self.local.path(
                CHECKPOINTS)) if not rundir.is_part(p)), default=-1)
            newer = [s for s in self.listing.steps(sealed=True) if local < s <= latest]
        except _failures() as exc:
            log.warning("cannot read checkpoints from %s (%s); resuming from the local "
                        "ones", self.where, said(exc))
            return None
        for step in newer:
            problem = self._fetch(step)
            if problem is None:
                log.info("fetched checkpoint step-%d from %s", step, self.where)
                return step
            log.warning("remote checkpoint %s/%s/%s is unusable (%s); trying the previous "
                        "one", self.where, CHECKPOINTS, rundir.step_name(step), problem)
        return None

    def fetch(self, step: int) -> str | None:
        """The remote checkpoint ``step`` into this node's run directory, whole and
        verified, sealed locally (:meth:`fetch_part` then :meth:`fetch_rest`). None, or
        what is wrong."""
        return self.fetch_part(step, None) or self.fetch_rest(step, None)

    def fetch_part(self, step: int, ranks: list[int] | None) -> str | None:
        """Node-local mode, each node's first rank, first half of a fetch: into
        ``step-N.partial``, what every rank of this node reads whatever its shards
        (state.pt, the rank files of ``ranks``, None: every one, and a sharded
        checkpoint's index), each file verified; the remote checksums.json is kept
        there for :meth:`fetch_rest`. None, or what is wrong (nothing left behind)."""
        final = f"{CHECKPOINTS}/{rundir.step_name(step)}"
        partial = f"{final}.partial"
        self.local.delete(partial)
        try:
            data, _ = self.remote.read(f"{final}/{CHECKSUMS}")
            sums = json.loads(data)
            problem = self._download(final, partial, sums,
                                     [n for n in sums if _read_by_every_rank(n, ranks)])
            if problem is None:
                self.local.replace(f"{partial}/{CHECKSUMS}", data)
        except _failures() as exc:
            problem = said(exc)
        if problem is not None:
            self.local.delete(partial)
        return problem

    def fetch_rest(self, step: int, shards: set[str] | None) -> str | None:
        """Second half: the shard files ``shards`` (names in the checkpoint; None: every
        file not fetched yet), verified; then the checkpoint is sealed locally with a
        checksums.json listing the files this node holds, and rank 0's node gets the
        record. None, or what is wrong (nothing left behind)."""
        final = f"{CHECKPOINTS}/{rundir.step_name(step)}"
        partial = f"{final}.partial"
        try:
            sums = json.loads(self.local.read_text(f"{partial}/{CHECKSUMS}"))
            here = [n for n in sums if self.local.exists(f"{partial}/{n}")]
            wanted = [n for n in sums if n not in here and (shards is None or n in shards)]
            problem = self._download(final, partial, sums, wanted)
        except _failures() as exc:
            problem = said(exc)
        if problem is not None:
            self.local.delete(partial)
            return problem
        held = {n: d for n, d in sums.items() if n in here or n in wanted}
        self.local.replace(f"{partial}/{CHECKSUMS}", (json.dumps(held, indent=1) + "\n").encode())
        if held != sums:  # this node's part: never resumed alone
            self.local.replace(f"{partial}/{NODE_PART}", b"")
        self._seal_fetched(step)
        if self.nodes.publishes:
            self._fetch_record()
        return None

    def drop_fetch(self, step: int) -> None:
        """A fetch another node failed: its first half goes."""
        self.local.delete(f"{CHECKPOINTS}/{rundir.step_name(step)}.partial")

    def _fetch(self, step: int) -> str | None:
        """Download one remote checkpoint whole and seal it locally (a run directory the
        ranks share); None, or what is wrong."""
        final = f"{CHECKPOINTS}/{rundir.step_name(step)}"
        partial = f"{final}.partial"
        self.local.delete(partial)
        try:
            sums = self._download_all(final, partial)
        except _failures() as exc:
            self.local.delete(partial)
            return said(exc)
        if isinstance(sums, str):
            self.local.delete(partial)
            return sums
        self._seal_fetched(step)
        self._fetch_record()
        return None

    def _seal_fetched(self, step: int) -> None:
        final = f"{CHECKPOINTS}/{rundir.step_name(step)}"
        self.local.delete(final)  # node-local mode: this node's part of it, now complete
        self.local.move(f"{final}.partial", final)
        self.local.replace(f"{CHECKPOINTS}/{LATEST}", f"{rundir.step_name(step)}\n".encode())

    def _fetch_record(self) -> None:
        """Into a run directory that has none: the record a resumed run goes on with."""
        for name in CONTINUED:
            if not self.local.exists(name):
                try:
                    self.local.replace(name, self.remote.read(name)[0])
                except errors() as exc:  # a run that mirrored none yet: start it afresh
                    if not missing(exc):
                        log.warning("cannot fetch %s from %s (%s); it starts afresh here",
                                    name, self.where, said(exc))

    def _download_all(self, final: str, partial: str) -> dict | str:
        """Every file of ``final`` into ``partial``, checked: the checksums, or a problem."""
        data, _ = self.remote.read(f"{final}/{CHECKSUMS}")
        sums = json.loads(data)
        problem = self._download(final, partial, sums, list(sums))
        if problem is not None:
            return problem
        self.local.replace(f"{partial}/{CHECKSUMS}", data)
        return sums

    def _download(self, final: str, partial: str, sums: dict, names: list[str]
                  ) -> str | None:
        """The files ``names`` of ``final`` into ``partial``, each checked against
        ``sums`` as it arrives (one this node holds already is kept): None, or what is
        wrong."""
        for name in names:
            target = self.local.path(f"{partial}/{name}")
            target.parent.mkdir(parents=True, exist_ok=True)
            if self._kept(f"{final}/{name}", sums[name], target):
                continue
            if self.remote.download(f"{final}/{name}", target) != sums[name]:
                return f"{name} does not match its checksum"
        return None

    def _kept(self, name: str, digest: str, target: Path) -> bool:
        """A file already here with ``digest`` (this node's own part): linked into the
        folder being fetched instead of downloaded again."""
        have = self.local.path(name)
        if not have.is_file() or self.local.digest(name) != digest:
            return False
        try:
            os.link(have, target)
        except OSError:  # a file system without hard links
            shutil.copyfile(have, target)
        return True


def _read_by_every_rank(name: str, ranks: list[int] | None) -> bool:
    """A checkpoint file every rank of a node holding ``ranks`` reads, whatever its
    shards: state.pt, those ranks' own rank files, a sharded checkpoint's index."""
    if name.startswith(f"{SHARDS}/"):
        return name == f"{SHARDS}/{SHARDS_INDEX}"
    own = RANK_FILE.match(name)
    return own is None or ranks is None or int(own[1]) in ranks
