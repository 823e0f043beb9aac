"""Token files in object storage, fetched whole into a bounded local folder.

A ``data.kind: tokens`` dataset may name ``s3://`` objects (:mod:`train.core.tokenfiles`
lists them). Training reads them from local copies: each object is fetched once, whole,
into ``data.cache_dir`` (node-local by default), where every process of the node finds
it: the ranks, their DataLoader workers, and the next start of the run. A per-object
``flock`` makes one process fetch while the others wait for it (the kernel drops the
lock of a process that dies mid-fetch; its partial file is never renamed into place).

What was fetched is checked against the listing the run started from: its size, and
its MD5 where the ETag is one (a single-part upload); a mismatch is one line naming the
object (it changed, or is corrupt), never silently different data. When the folder
would grow past ``data.cache_bytes`` the least recently used files go first; a process
reading an evicted file fetches it again. Why whole files and not byte ranges, and what
a cache smaller than the dataset costs: docs/object-storage.md ("Training data").

The client is the checkpoints' own (:class:`train.checkpoint.objectstore.S3Storage`,
boto3, credentials the AWS way), made once per process: a boto3 client must not cross
a fork into a DataLoader worker.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from train.core.tokenfiles import TokenFile

log = logging.getLogger("train")

CHUNK = 8 << 20
ATTEMPTS = 3     # fetches of one object before its read fails
PLAIN_MD5 = re.compile(r"^[0-9a-f]{32}$")  # a multipart upload's ETag is not the MD5


class DataFileError(RuntimeError):
    """A data file that cannot be used: one line naming it."""


def default_folder() -> Path:
    return Path(tempfile.gettempdir()) / "trainpod-data"


def cache_name(f: TokenFile) -> str:
    """The local name of an object: its URL and ETag hashed (a replaced object is a new
    file), then its own name for a reader of the folder."""
    tag = hashlib.sha256(f"{f.name}\0{f.etag}".encode()).hexdigest()[:16]
    return f"{tag}-{f.name.rpartition('/')[2]}"


class ShardCache:
    """A folder of fetched objects, at most ``limit`` bytes (see the module's docstring)."""

    def __init__(self, folder: Path, limit: int):
        self.folder, self.limit = Path(folder), limit
        self._client: tuple[int, object] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_client": None}

    def path(self, f: TokenFile) -> Path:
        return self.folder / cache_name(f)

    def local(self, f: TokenFile) -> Path:
        """The local copy of ``f``, fetched first when it is not there."""
        path = self.path(f)
        if path.exists():
            with contextlib.suppress(OSError):
                os.utime(path)  # recently used: evicted last
            return path
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f".{path.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be fetching it
            if not path.exists():
                self._make_room(f.size)
                self._fetch(f, path)
        return path

    def _storage(self, bucket: str):
        from train.checkpoint.objectstore import S3Storage
        if self._client is None or self._client[0] != os.getpid():
            self._client = (os.getpid(), S3Storage(bucket, attempts=5).s3)
        return S3Storage(bucket, s3=self._client[1])

    def _fetch(self, f: TokenFile, path: Path) -> None:
        """Fetch ``f`` into ``path``; a connection that fails mid-way is tried again
        (botocore retries a request, not a body cut off while it streams)."""
        from train.checkpoint.objectstore import missing, said
        for attempt in range(1, ATTEMPTS + 1):
            try:
                size = self._fetch_once(f, path)
                break
            except DataFileError:
                raise
            except Exception as exc:  # the store's or the network's answer, in one line
                if missing(exc):
                    raise DataFileError(f"{f.name}: not in the store (it was listed when "
                                        "the run started)") from None
                if attempt == ATTEMPTS:
                    raise DataFileError(f"{f.name}: cannot fetch ({ATTEMPTS} attempts): "
                                        f"{said(exc)}") from None
                log.warning("fetching %s: %s; trying again", f.name, said(exc))
                time.sleep(attempt)
        log.info("fetched %s (%d bytes) into %s", f.name, size, self.folder)

    def _fetch_once(self, f: TokenFile, path: Path) -> int:
        bucket, key = f.bucket_key()
        part = path.with_name(f".{path.name}.{os.getpid()}.part")
        md5, size = hashlib.md5(usedforsecurity=False), 0
        try:
            body = self._storage(bucket).open(key)
            with body, open(part, "wb") as out:
                for chunk in iter(lambda: body.read(CHUNK), b""):
                    md5.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
            _check(f, size, md5.hexdigest())
            os.replace(part, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                part.unlink()
        return size

    def _make_room(self, need: int) -> None:
        """Remove the least recently used files until ``need`` more bytes fit."""
        held = []
        for p in self.folder.iterdir():
            if not p.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    held.append((st.st_mtime_ns, st.st_size, p))
        total = sum(size for _, size, _ in held)
        for _, size, p in sorted(held):
            if total + need <= self.limit:
                break
            with contextlib.suppress(FileNotFoundError):
                p.unlink()  # a process that has it mapped keeps reading its pages
            total -= size

    def read_ahead(self, files: Iterable[TokenFile]) -> threading.Thread:
        """Fetch ``files`` in this order in the background, as many as the cache holds."""
        def run() -> None:
            budget = self.limit
            for f in files:
                budget -= f.size
                if budget < 0:
                    return
                try:
                    self.local(f)
                except DataFileError:
                    return  # the reader that needs it says so, in its own step
        thread = threading.Thread(target=run, name="data-read-ahead", daemon=True)
        thread.start()
        return thread


def _check(f: TokenFile, size: int, md5: str) -> None:
    if size != f.size:
        raise DataFileError(f"{f.name}: fetched {size} bytes, the store listed {f.size} when "
                            "the run started: the object changed or is corrupt")
    if PLAIN_MD5.match(f.etag) and md5 != f.etag:
        raise DataFileError(f"{f.name}: its bytes' MD5 {md5} is not the store's ETag "
                            f"{f.etag}: corrupt in transit or changed since the listing")
