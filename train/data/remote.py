"""Objects in S3-compatible storage for your own code: a ``data.kind: custom`` factory, its
dataset, or any script run under the trainer.

``fetch("s3://BUCKET/KEY")`` returns the path of a local copy of the object, fetched
once per node into the same bounded cache that ``data.kind: tokens`` and ``text`` use
(:mod:`.shardcache`: ``data.cache_dir``, ``data.cache_bytes``; one process fetches while
the others of the node wait for it) and checked against the store's size and MD5 ETag;
``open(url)`` opens that copy for reading. Credentials and endpoint come from boto3's
default chain, as for checkpoints (docs/object-storage.md), never from the config.

A process asks the store for an object's size and ETag the first time it names it, and
keeps that answer: the object must stay as it is while the run reads it (a replaced one
fails the fetch, naming it). The trainer points the cache at the run's ``data.cache_dir``
before it calls the data factory (:func:`use_cache`); elsewhere, and in a process that
does not inherit it (a spawned DataLoader worker), the defaults apply.

Errors are one line naming the URL: an object that is not there is a
:class:`FileNotFoundError` (the trainer says it as bad input, exit 2), a corrupt one a
:class:`~.shardcache.DataFileError`, and without boto3 or a reachable store a
:class:`~train.core.errors.CannotRunHere` (exit 3) says what to do.
"""

from __future__ import annotations

import builtins
import importlib.util
from pathlib import Path
from typing import IO, Any

from train.core.config import DataConfig
from train.core.datasets.tokenfiles import MAGIC, TokenFile
from train.core.errors import CannotRunHere
from train.core.storage import s3, urls
from train.data.shardcache import ShardCache, default_folder

__all__ = ["fetch", "open", "use_cache"]

DEFAULT_CACHE_BYTES = DataConfig().cache_bytes
_cache = ShardCache(default_folder(), DEFAULT_CACHE_BYTES)
_known: dict[str, TokenFile] = {}           # url -> its size and ETag, as first asked


def use_cache(folder: str | Path | None, limit: int) -> None:
    """Where :func:`fetch` keeps its copies in this process and those it forks
    (None: the default folder), and the most bytes it keeps there."""
    global _cache
    _cache = ShardCache(Path(folder) if folder else default_folder(), limit)


def fetch(url: str) -> Path:
    """The path of a verified local copy of the object ``url`` (``s3://BUCKET/KEY``).

    The copy may be evicted later to make room for others: open it soon (or use
    :func:`open`); a process that holds it open keeps reading it."""
    return _cache.local(_describe(url))


def open(url: str, mode: str = "rb", **kwargs: Any) -> IO:
    """The object ``url`` opened for reading (``mode`` "rb", "r", ...; ``kwargs`` as
    for the built-in open, e.g. ``encoding``), from its local copy."""
    if any(c in mode for c in "wax+"):
        raise ValueError(f"{url}: mode {mode!r}: objects are opened for reading only")
    return builtins.open(fetch(url), mode, **kwargs)


def _describe(url: str) -> TokenFile:
    """The object's size and ETag, asked once per process."""
    if url in _known:
        return _known[url]
    bucket, _, key = url[len("s3://"):].partition("/") if url.startswith("s3://") else ("", "", "")
    if not urls.BUCKET.match(bucket) or not key or any(c in key for c in MAGIC) \
            or not key.isprintable():
        raise ValueError(f"{url!r} is not an object URL; s3://BUCKET/KEY, without a pattern")
    if importlib.util.find_spec("boto3") is None:
        raise CannotRunHere(f"{url} needs boto3, which is not installed here: "
                            f"{s3.INSTALL}")
    try:
        head = _s3().head_object(Bucket=bucket, Key=key)
    except s3.errors() as exc:  # whatever the store or the network says
        if s3.missing(exc):
            raise FileNotFoundError(f"{url}: no such object in bucket {bucket}") from None
        raise CannotRunHere(f"cannot read {url} at {s3.endpoint()}: "
                            f"{s3.said(exc)}; check the AWS_* variables "
                            "(docs/object-storage.md)") from None
    _known[url] = TokenFile(url, head["ContentLength"], head.get("ETag", "").strip('"'))
    return _known[url]


def _s3():
    return s3.shared()  # the cache's and the listing's: made once per process
