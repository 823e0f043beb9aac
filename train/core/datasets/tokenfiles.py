"""Which files a ``data.kind: tokens`` dataset is made of: ``data.path`` resolved (also
for ``data.kind: text`` when its ``data.path`` names files or objects, not a folder).

``data.path`` is one entry or a list of them; an entry is a local file, a local glob
(``shards/*.bin``), an object ``s3://BUCKET/KEY`` or an object glob
``s3://BUCKET/PREFIX/*.bin`` (``*.txt`` for text). The dataset is the files in list
order, each entry's matches sorted by name: the same list on every rank and every
start, which the global sample order relies on. The launcher resolves it before any
worker starts (a pattern matching nothing, a missing file or an object the store does
not have is exit 2, naming it; a store it cannot reach, or no boto3, is exit 3) and the
workers resolve it again, getting the same list.

An object glob lists the objects under the pattern's fixed part (everything before its
first ``*``, ``?`` or ``[``) and keeps the keys matching it (``fnmatch``: ``*`` also
matches ``/``). Each object's size and ETag come with the listing: the cache
(:mod:`train.data.shardcache`) checks what it fetched against them.
"""

from __future__ import annotations

import fnmatch
import glob
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from train.core.errors import CannotRunHere, ConfigError
from train.core.storage import s3, urls

KEY = "data.path"
MAGIC = "*?["


@dataclass(frozen=True)
class TokenFile:
    name: str            # a local path, or s3://BUCKET/KEY
    size: int
    etag: str = ""       # objects only: the store's ETag when listed

    @property
    def remote(self) -> bool:
        return self.name.startswith("s3://")

    def bucket_key(self) -> tuple[str, str]:
        bucket, _, key = self.name[len("s3://"):].partition("/")
        return bucket, key


def entries(path: str | list[str] | None) -> list[str]:
    return [] if path is None else [path] if isinstance(path, str) else list(path)


def is_remote(path: str | list[str] | None) -> bool:
    return any(e.startswith("s3://") for e in entries(path))


# What data.path may name, by data.kind, for the message of an empty one
EXPECTED = {"tokens": "a .bin file, a glob, an s3:// URL or a list of them",
            "text": "a folder, a text file, a glob, an s3:// URL or a list of them"}


def resolve(path: str | list[str] | None, source: str, kind: str = "tokens") -> list[TokenFile]:
    """The dataset's files in order (see the module's docstring)."""
    found: list[TokenFile] = []
    for entry in entries(path):
        found += _remote(entry, source) if entry.startswith("s3://") else _local(entry, source)
    seen: set[str] = set()
    for f in found:
        if f.name in seen:
            raise ConfigError(source, KEY, f"{f.name} is listed twice; each file may be "
                                           "part of the dataset once")
        seen.add(f.name)
    if not found:
        raise ConfigError(source, KEY, f"required for data.kind={kind}: {EXPECTED[kind]}")
    return found


def _local(entry: str, source: str) -> list[TokenFile]:
    if any(c in entry for c in MAGIC) and not Path(entry).is_file():  # data[1].bin: a file
        names = sorted(p for p in glob.glob(entry, recursive=True) if Path(p).is_file())
        if not names:
            raise ConfigError(source, KEY, f"{entry}: no file matches")
    else:
        if not Path(entry).is_file():
            raise ConfigError(source, KEY, f"{entry}: no such file")
        names = [entry]
    return [TokenFile(n, Path(n).stat().st_size) for n in names]


def _remote(entry: str, source: str) -> list[TokenFile]:
    bucket, _, pattern = entry[len("s3://"):].partition("/")
    if not urls.BUCKET.match(bucket) or not pattern.strip("/") \
            or not pattern.isprintable():
        raise ConfigError(source, KEY, f"{entry!r} is not an object URL; "
                                       "s3://BUCKET/KEY or s3://BUCKET/PREFIX/*.EXT")
    if importlib.util.find_spec("boto3") is None:
        raise CannotRunHere(f"{source}: {KEY}: {entry} needs boto3, which is not installed "
                            f"here: {s3.INSTALL}")
    fixed = pattern
    for c in MAGIC:
        fixed = fixed.split(c, 1)[0]
    try:
        listed = _list(bucket, fixed)
    except Exception as exc:  # whatever the store or the network says
        raise CannotRunHere(f"{source}: {KEY}: cannot list {entry} at "
                            f"{s3.endpoint()}: {s3.said(exc)}; check "
                            "the AWS_* variables (docs/object-storage.md)") from None
    keys = sorted(k for k in listed if fnmatch.fnmatchcase(k, pattern))
    if not keys:
        raise ConfigError(source, KEY, f"{entry}: no object matches in bucket {bucket}")
    return [TokenFile(f"s3://{bucket}/{k}", *listed[k]) for k in keys]


def _list(bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
    """{key: (size, ETag)} of every object under ``prefix``."""
    pages = s3.shared().get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix)
    return {o["Key"]: (o["Size"], o.get("ETag", "").strip('"'))
            for page in pages for o in page.get("Contents", [])}
