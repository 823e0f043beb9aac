"""The remote tier (``checkpoint.remote``): a run's sealed checkpoints mirrored to object
storage, and fetched back when the store holds one the local disk lacks.

Composed of three objects over one key prefix of a bucket (the run's
``PREFIX/RUN_NAME``, a :class:`~train.core.storage.bucket.S3Storage`) and the run
directory (a :class:`~train.core.storage.local.LocalStorage`): what the store holds
(:class:`~.listing.RemoteListing`), the uploader of each sealed checkpoint
(:class:`~.uploader.Uploader`: the protocol, step by step) and the fetcher of a remote
one when a start resumes from it (:class:`~.fetcher.Fetcher`). Built once, by
:func:`tier_for`, for the rank that uploads (rank 0, or in node-local mode each node's
first rank: :class:`~.listing.Nodes`); the checkpointer is handed it
(:mod:`.factory`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from train.checkpoint.fetcher import Fetcher
from train.checkpoint.listing import Nodes, RemoteListing
from train.checkpoint.uploader import Uploader
from train.core.storage import urls
from train.core.storage.bucket import S3Storage
from train.core.storage.local import LocalStorage


@dataclass(frozen=True)
class RemoteTier:
    """One run's checkpoints in the store: ``remote`` (its key prefix), ``where`` (its
    URL, for messages), and the objects that read, upload and fetch them."""
    remote: S3Storage
    where: str
    nodes: Nodes
    listing: RemoteListing
    uploader: Uploader
    fetcher: Fetcher

    @classmethod
    def from_url(cls, url: str, run_name: str, local: LocalStorage, keep_last: int,
                 nodes: Nodes | None = None) -> RemoteTier:
        parsed, problem = urls.parse(url)
        if parsed is None:
            raise ValueError(problem)
        where = f"s3://{parsed.bucket}/{parsed.run_prefix(run_name)}"
        # botocore retries a request once; whole files are retried by the uploader
        remote = S3Storage(parsed.bucket, parsed.run_prefix(run_name), attempts=2)
        nodes = nodes or Nodes()
        listing = RemoteListing(remote, nodes)
        return cls(remote, where, nodes, listing,
                   Uploader(remote, local, listing, keep_last, where, nodes),
                   Fetcher(remote, local, listing, where, nodes))


def tier_for(url: str | None, run_dir: Path, run_name: str, keep_last: int,
             nodes: Nodes | None = None) -> RemoteTier | None:
    """The run's remote tier, or None when ``checkpoint.remote`` is off."""
    if not url:
        return None
    return RemoteTier.from_url(url, run_name, LocalStorage(run_dir), keep_last, nodes)
