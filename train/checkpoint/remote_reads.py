"""What the remote tier reads back from the store: the remote ``latest`` and step
folders, the nodes' parts of a checkpoint (node-local mode), and the fetch of a remote
checkpoint into the run directory when a start resumes from it. The protocol is
:mod:`.remote`'s; this is the half of :class:`~.remote.RemoteTier` that reads."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from train.core import rundir
from train.core.rundir import (
    CHECKPOINTS,
    CHECKSUMS,
    LATEST,
    MANIFEST,
    METRICS,
    NODE_PART,
    SHARDS,
    STEP_DIR,
)
from train.core.storage.s3 import missing, said

log = logging.getLogger("train")

CONTINUED = (METRICS, MANIFEST)  # the record files a resumed run appends to
PARTS = ".parts"                 # a step's node markers (node-local mode)
SHARDS_INDEX = ".metadata"       # DCP's index of a sharded checkpoint, in SHARDS/
RANK_FILE = re.compile(r"^rank-(\d+)\.pt$")  # rundir.rank_file's names


class RemoteError(Exception):
    """The store did not take (or give back) a checkpoint."""


class StoreReads:
    """The reading half of the remote tier (attributes set by :class:`~.remote.RemoteTier`)."""
    @staticmethod
    def part_name(step: int, node: int) -> str:
        return f"{CHECKPOINTS}/{rundir.step_name(step)}/{PARTS}/node-{node}.json"

    def parts(self, step: int, token: str | None, whole: dict | None) -> dict | None:
        """One look at the nodes' markers of ``step``: the whole checkpoint's checksums
        when every node's part of the save ``token`` is there, or None. A part that
        disagrees (a file two nodes list with other checksums, or not what the ranks
        reported: ``whole``) is a RemoteError: never sealed."""
        merged: dict[str, str] = {}
        for node in self.nodes:
            try:
                part = json.loads(self.remote.read(self.part_name(step, node))[0])
            except Exception as exc:
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
        except Exception as exc:
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

    # ------------------------------------------------------------ resuming
    def fetch_newer(self) -> int | None:
        """Rank 0, before choosing a checkpoint: the newest remote checkpoint (up to the
        remote ``latest``) newer than every local one, downloaded, verified and sealed
        locally. The step fetched, or None (none newer, or the store unreachable: a
        warning, and the local checkpoints are used)."""
        try:
            latest, _ = self.latest()
            if latest is None:
                return None
            local = max((rundir.step_of(p) for p in rundir.step_dirs(self.local.path(
                CHECKPOINTS)) if not rundir.is_part(p)), default=-1)
            newer = [s for s in self.steps(sealed=True) if local < s <= latest]
        except Exception as exc:
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

    def sealed_steps(self) -> list[int]:
        """The remote checkpoints a resume may take, newest first: sealed, up to
        ``latest``. Raises when the store cannot be read."""
        latest, _ = self.latest()
        return [] if latest is None else [s for s in self.steps(sealed=True) if s <= latest]

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
        except Exception as exc:
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
        except Exception as exc:
            problem = said(exc)
        if problem is not None:
            self.local.delete(partial)
            return problem
        held = {n: d for n, d in sums.items() if n in here or n in wanted}
        self.local.replace(f"{partial}/{CHECKSUMS}", (json.dumps(held, indent=1) + "\n").encode())
        if held != sums:  # this node's part: never resumed alone
            self.local.replace(f"{partial}/{NODE_PART}", b"")
        self._seal_fetched(step)
        if self.publishes:
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
        except Exception as exc:
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
                except Exception as exc:  # a run that mirrored none yet: start it afresh
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
