"""The remote tier's uploader: sealed checkpoints mirrored to object storage
(``checkpoint.remote``).

Each checkpoint is written and sealed locally first, exactly as without a remote (the
protocol of :mod:`.store`); then rank 0 hands it to :meth:`Uploader.sealed` and a
background thread uploads it, so training never waits for the network:

1. every file ``checksums.json`` lists, each read back from the store and hashed after
   its upload: a checkpoint counts as uploaded only when every byte in the store matches
   its SHA-256 (the strongest check any S3-compatible store allows: it costs a download
   of what was uploaded, docs/object-storage.md);
2. ``checksums.json`` itself: the checkpoint is now sealed remotely;
3. the run's record beside the checkpoints (:data:`RECORD`: metrics.jsonl, manifest.json,
   config.yaml, result.json, and the TensorBoard event files that grew), so that a run
   without a shared volume can be read with ``aws s3 sync`` and a pod with an empty disk
   continues its metrics where the checkpoint left them: sent before ``latest`` names
   the step, so the record beside any step ``latest`` names holds that step's metrics;
4. the remote ``latest``, only when it names an older step (never moved backwards by a
   stale writer), written conditionally on the ETag read where the store supports it;
5. ``checkpoint.keep_last`` applied to the remote step folders.

A failed operation is retried with backoff; a store that stays unreachable is one
warning for the whole run (the local checkpoints still protect it) and each later
checkpoint is tried once more when it seals. Only the newest sealed checkpoint waits
for upload: an older one not started yet is skipped.

Resuming from the store is the fetcher's (:mod:`.fetcher`).

Node-local run directories (:mod:`train.guards.shared_dir`): each node's first rank has a
tier (built with its :class:`~.listing.Nodes`) and uploads its node's part, each file verified as
above, then a marker ``step-N/.parts/node-K.json`` listing those files, their SHA-256 and
the save's token. Rank 0's tier then waits for every node's marker of that save and
writes ``checksums.json`` only when they are all there and agree (with each other, and
with the checksums the ranks exchanged, for a foreground save); steps 3-5 follow as
above, from rank 0 alone.

What the store holds (``latest``, the step folders, the nodes' parts) is read through
:class:`~.listing.RemoteListing`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from train.checkpoint.listing import Nodes, RemoteError, RemoteListing, part_name
from train.core.run import rundir
from train.core.run.rundir import (
    BOARD,
    CHECKPOINTS,
    CHECKSUMS,
    CONFIG,
    LATEST,
    MANIFEST,
    METRICS,
    RESULT,
)
from train.core.storage.bucket import S3Storage
from train.core.storage.local import LocalStorage
from train.core.storage.s3 import code, errors, said

log = logging.getLogger("train")

BACKOFF_S = (1.0, 2.0, 4.0)   # between the attempts at one operation
POLL_S = 0.5                  # between looks for the other nodes' parts
RECORD = (METRICS, MANIFEST, CONFIG, RESULT)  # the run's own files, mirrored with each seal


class Superseded(Exception):
    """A newer checkpoint sealed while this one waited for other nodes' parts."""


class Record:
    """The run's own files beside its checkpoints in the store (:data:`RECORD` and the
    TensorBoard event files), so that a run without a shared volume can be read with
    ``aws s3 sync`` and a pod with an empty disk continues its metrics."""

    def __init__(self, remote: S3Storage, local: LocalStorage):
        self.remote, self.local = remote, local
        self._board_sent: dict[str, int] = {}  # event file -> size last uploaded

    def send(self) -> None:
        """The record as it is now. metrics.jsonl is appended while this runs: only its
        whole lines are sent. An event file is sent again only when it grew."""
        for name in RECORD:
            path = self.local.path(name)
            if path.is_file():
                data = path.read_bytes()
                self.remote.replace(name, data[:data.rfind(b"\n") + 1] if name == METRICS
                                    else data)
        board = self.local.path(BOARD)
        for path in sorted(board.rglob("*")) if board.is_dir() else ():
            name = path.relative_to(self.local.path()).as_posix()
            size = path.stat().st_size if path.is_file() else None
            if size is not None and self._board_sent.get(name) != size:
                self.remote.upload(name, path)
                self._board_sent[name] = size


class Uploader:
    """Mirrors one run's sealed checkpoints from ``local`` (the run directory's storage)
    to ``remote`` (the run's key prefix, listed by ``listing``); ``where``: its URL, for
    messages; ``nodes``: where this tier runs (node-local mode or not)."""

    def __init__(self, remote: S3Storage, local: LocalStorage, listing: RemoteListing,
                 keep_last: int, where: str, nodes: Nodes,
                 sleep: Callable[[float], None] = time.sleep):
        self.remote, self.local, self.listing = remote, local, listing
        self.keep_last, self.where, self.nodes, self.sleep = keep_last, where, nodes, sleep
        self._lock = threading.Condition()
        self._pending: int | None = None     # the newest sealed step not started yet
        self._busy: int | None = None        # the step being uploaded
        self._thread: threading.Thread | None = None
        self.unreachable = False             # warned once: no more backoff after that
        self.uploaded: int | None = None     # the newest step sealed remotely by this run
        self.record = Record(remote, local)
        self._seals: dict[int, tuple[str | None, dict | None]] = {}  # step -> token, sums

    def sealed(self, step: int, token: str | None = None, whole: dict | None = None) -> None:
        """A checkpoint (node-local mode: this node's part of it, of the save ``token``,
        with every rank's checksums ``whole`` when known) was sealed locally: upload it
        in the background."""
        with self._lock:
            self._pending = step
            self._seals[step] = (token, whole)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._uploads, daemon=True,
                                                name="checkpoint-upload")
                self._thread.start()

    def wait(self, timeout_s: float, warn: bool = True) -> int | None:
        """Wait up to ``timeout_s`` for the uploads to finish; the step left only local
        (named in a warning unless ``warn`` is off: the caller says it) or None."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._pending is not None or self._busy is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            behind = self._pending if self._pending is not None else self._busy
        if behind is not None and warn:
            log.warning("checkpoint step-%d is only local: its upload to %s did not finish "
                        "within %.0f s", behind, self.where, timeout_s)
        return behind

    def _uploads(self) -> None:
        while True:
            with self._lock:
                step, self._pending = self._pending, None
                self._busy = step
                seal = self._seals.pop(step, (None, None))
                self._seals.clear()  # older ones skipped
                if step is None:
                    self._lock.notify_all()
                    return
            try:
                self.mirror(step, *seal)
            except Superseded:
                log.info("checkpoint step-%d not sealed remotely: a newer one sealed while it "
                         "waited for the other nodes' parts", step)
            except (*errors(), RemoteError, ValueError) as exc:  # the run goes on: its
                # local checkpoints protect it (ValueError: a checksums.json not JSON)
                if self.local.exists(f"{CHECKPOINTS}/{rundir.step_name(step)}"):
                    self._unreachable(step, exc)
                else:  # keep_last removed it locally while it uploaded: a newer one follows
                    log.info("checkpoint step-%d not uploaded: superseded before its upload "
                             "finished", step)
            finally:
                with self._lock:
                    self._busy = None
                    self._lock.notify_all()

    def _unreachable(self, step: int, exc: BaseException) -> None:
        if not self.unreachable:
            self.unreachable = True
            log.warning("checkpoint upload to %s failed (%s): step-%d and later checkpoints "
                        "stay local until the store answers again; training goes on",
                        self.where, said(exc), step)
        else:
            log.debug("checkpoint step-%d not uploaded: %s", step, said(exc))

    def mirror(self, step: int, token: str | None = None, whole: dict | None = None) -> None:
        """Upload the locally sealed step, verify it, seal it remotely, name it latest.
        Node-local mode: this node's part, its marker, and on rank 0 the seal once every
        node's part is there."""
        folder = f"{CHECKPOINTS}/{rundir.step_name(step)}"
        sums = json.loads(self.local.read_text(f"{folder}/{CHECKSUMS}"))
        for name, digest in sums.items():
            self._retry(lambda n=name, d=digest: self._upload(f"{folder}/{n}", d))
        if self.nodes.node is None:
            self._retry(lambda: self.remote.upload(f"{folder}/{CHECKSUMS}",
                                                   self.local.path(f"{folder}/{CHECKSUMS}")))
        else:
            part = json.dumps({"token": token, "files": sums}, indent=1).encode()
            self._retry(lambda: self.remote.replace(part_name(step, self.nodes.node), part))
            if self.nodes.publishes:
                sealed = self._wait_for_parts(step, token, whole)
                self._retry(lambda: self.remote.replace(
                    f"{folder}/{CHECKSUMS}", (json.dumps(sealed, indent=1) + "\n").encode()))
        if self.nodes.publishes:
            # the record before latest: whoever resumes from this step finds its metrics
            self._retry(self.mirror_record)
            self._retry(lambda: self._name_latest(step))
            self._retry(self._prune)
        self.uploaded = step
        log.info("checkpoint step-%d is in %s", step, self.where)
        if self.unreachable:
            log.warning("checkpoint uploads to %s work again: step-%d is there", self.where,
                        step)
            self.unreachable = False

    def mirror_record(self) -> None:
        """The run's record as it is now (:class:`Record`)."""
        self.record.send()

    def _wait_for_parts(self, step: int, token: str | None, whole: dict | None) -> dict:
        """Every node's part of ``step``, up to ``parts_timeout_s``; Superseded as soon as
        a newer checkpoint waits for upload (its nodes may skip this one)."""
        deadline = time.monotonic() + self.nodes.parts_timeout_s
        while True:
            merged = self._retry(lambda: self.listing.parts(step, token, whole))
            if merged is not None:
                return merged
            with self._lock:
                if self._pending is not None:
                    raise Superseded()
            if time.monotonic() > deadline:
                raise RemoteError(f"not every node's part of step-{step} reached the store "
                                  f"within {self.nodes.parts_timeout_s:.0f} s")
            self.sleep(POLL_S)

    def _upload(self, name: str, digest: str) -> None:
        self.remote.upload(name, self.local.path(name))
        stored = self.remote.digest(name)
        if stored != digest:
            raise RemoteError(f"{name} reads back with another checksum than was uploaded")

    def _retry(self, action: Callable[[], Any]) -> Any:
        """``action``'s result, trying again after each failure with backoff; once the
        store has been found unreachable, a single attempt (the next checkpoint tries
        again)."""
        delays = () if self.unreachable else BACKOFF_S
        for delay in delays:
            try:
                return action()
            except RemoteError:
                raise  # a disagreement: another attempt reads the same
            except errors():  # retried; the last attempt's error is the one raised
                self.sleep(delay)
        return action()

    def _name_latest(self, step: int) -> None:
        """``latest`` names ``step`` unless it names a newer one already. Conditional on
        the ETag read (a writer that raced this one makes it read and compare again)
        where the store supports conditional writes."""
        for _ in range(5):
            current, etag = self.listing.latest()
            if current is not None and current > step:
                log.info("remote latest names step-%d, newer than step-%d: left as it is",
                         current, step)
                return
            data = f"{rundir.step_name(step)}\n".encode()
            condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
            try:
                self.remote.replace(f"{CHECKPOINTS}/{LATEST}", data, **condition)
                return
            except errors() as exc:
                if code(exc) == "PreconditionFailed":
                    continue  # another writer in between: compare again
                if code(exc) not in ("NotImplemented", "InvalidArgument", "InvalidRequest"):
                    raise
                self.remote.replace(f"{CHECKPOINTS}/{LATEST}", data)  # no conditional writes
                return
        raise RemoteError("the remote latest kept changing under this writer")

    def _prune(self) -> None:
        """keep_last remotely: the newest ``keep_last`` up to ``latest``; nothing newer
        than ``latest`` is touched (another writer's, or one being uploaded)."""
        latest, _ = self.listing.latest()
        if latest is None:
            return
        kept = [s for s in self.listing.steps(sealed=True) if s <= latest][:self.keep_last]
        # older ones, and uploads that never sealed (a store that went away mid-way)
        for step in [s for s in self.listing.steps() if s <= latest and s not in kept]:
            self.remote.delete(f"{CHECKPOINTS}/{rundir.step_name(step)}")

