"""An S3-compatible bucket as a :class:`~.seam.Storage`: the second implementation of
the storage seam, used by the remote tier (:mod:`train.checkpoint.tier`) to mirror sealed
checkpoints, and by the data cache (:mod:`train.data.shardcache`) to fetch objects.

Names are the same relative names the store uses ("checkpoints/step-4/state.pt"), under
a key prefix (the run's ``PREFIX/RUN_NAME``). A "folder" is a key prefix ending in
``/``. What an object store cannot do is not offered: there is no atomic rename, so a
checkpoint is sealed remotely by the order of its writes instead (every file, then
``checksums.json``, then ``latest``: :mod:`train.checkpoint.uploader`).

The client is boto3 (docs/object-storage.md says why): credentials, region and endpoint
come from its default chain (``AWS_*`` variables, ``AWS_PROFILE`` and the shared files,
IRSA and other web-identity tokens, instance metadata), never from the config. Big files
go through boto3's managed transfer (multipart, several connections at once).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from train.core.storage.s3 import client, missing

__all__ = ["S3Storage"]

# boto3 logs where it found the credentials at INFO (a run's root logger shows INFO): not
# a secret, but nothing a run's log needs
for _name in ("boto3", "botocore", "s3transfer", "urllib3"):
    logging.getLogger(_name).setLevel(logging.WARNING)
CHUNK = 8 << 20
# boto3 is imported where a bucket is used, never at import: the trainer imports this
# module whatever the config, and the base install has no boto3 (an optional extra)


def _client_error() -> type[Exception]:
    import botocore.exceptions
    return botocore.exceptions.ClientError


def _transfer():
    from boto3.s3.transfer import TransferConfig
    return TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=32 << 20,
                          max_concurrency=8, use_threads=True)


class S3Storage:
    """A key prefix of a bucket."""

    def __init__(self, bucket: str, prefix: str = "", *, attempts: int = 3, s3=None):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.s3 = s3 if s3 is not None else client(attempts)

    def key(self, name: str = "") -> str:
        return "/".join(p for p in (self.prefix, name.strip("/")) if p)

    def folder(self, name: str) -> S3Storage:
        return S3Storage(self.bucket, self.key(name), s3=self.s3)

    # --------------------------------------------------------------- Storage
    def write(self, name: str, fill: Callable[[BinaryIO], None]) -> str:
        buffer = io.BytesIO()
        fill(buffer)
        data = buffer.getvalue()  # in memory anyway: one PUT, then its hash
        self.replace(name, data)
        return hashlib.sha256(data).hexdigest()

    def replace(self, name: str, data: bytes, **conditions) -> dict:
        """One PUT (atomic in S3: a reader sees the old object or the new one).
        ``conditions``: IfMatch / IfNoneMatch, for a conditional write."""
        return self.s3.put_object(Bucket=self.bucket, Key=self.key(name), Body=data,
                                  **conditions)

    def open(self, name: str) -> BinaryIO:
        return self.get(name)["Body"]

    def get(self, name: str) -> dict:
        """The store's answer to a GET: the body to stream, and the object's ContentLength
        and ETag as they are now."""
        return self.s3.get_object(Bucket=self.bucket, Key=self.key(name))

    def read(self, name: str) -> tuple[bytes, str | None]:
        """(the bytes, the object's ETag) of a small object."""
        got = self.s3.get_object(Bucket=self.bucket, Key=self.key(name))
        return got["Body"].read(), got.get("ETag")

    def digest(self, name: str) -> str:
        """SHA-256 of the stored object, read back in chunks."""
        sha = hashlib.sha256()
        for chunk in self._chunks(name):
            sha.update(chunk)
        return sha.hexdigest()

    def names(self, folder: str = "") -> list[str]:
        top = self.key(folder)
        found: set[str] = set()
        pages = self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{top}/" if top else "", Delimiter="/")
        for page in pages:
            found |= {p["Prefix"].rstrip("/").rpartition("/")[2]
                      for p in page.get("CommonPrefixes", [])}
            found |= {o["Key"].rpartition("/")[2] for o in page.get("Contents", [])}
        return sorted(found - {""})

    def exists(self, name: str) -> bool:
        try:
            self.s3.head_object(Bucket=self.bucket, Key=self.key(name))
            return True
        except _client_error() as exc:
            if not missing(exc):
                raise
        return bool(list(self._keys(name, limit=1)))

    def delete(self, name: str) -> None:
        """An object, or every object under the folder ``name``."""
        keys = [self.key(name), *self._keys(name)]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes 1000 at most
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    # ----------------------------------------------------------- transfers
    def upload(self, name: str, path: Path) -> None:
        """A local file as the object ``name`` (multipart and parallel when big)."""
        self.s3.upload_file(str(path), self.bucket, self.key(name), Config=_transfer())

    def download(self, name: str, path: Path) -> str:
        """The object ``name`` into the new local file ``path``, durably; returns its
        SHA-256, computed while the bytes arrive."""
        sha = hashlib.sha256()
        with open(path, "xb") as f:
            for chunk in self._chunks(name):
                sha.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        return sha.hexdigest()

    def _chunks(self, name: str) -> Iterator[bytes]:
        body = self.open(name)
        try:
            yield from iter(lambda: body.read(CHUNK), b"")
        finally:
            body.close()

    def _keys(self, folder: str, limit: int | None = None) -> Iterator[str]:
        """Every key under the folder ``folder`` (all depths)."""
        pages = self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.key(folder)}/")
        n = 0
        for page in pages:
            for o in page.get("Contents", []):
                yield o["Key"]
                n += 1
                if limit is not None and n >= limit:
                    return
