"""The S3 client every user of object storage shares (checkpoints, data, the run's lease),
what its errors say, and the checks the launcher makes of ``checkpoint.remote`` before any
worker starts.

The URL itself is :mod:`.urls`'; a malformed one is bad input (exit 2, from the config
checks). boto3 not installed, or a bucket that cannot be reached or written, is "cannot
run here" (exit 3, from :func:`check`), naming the endpoint and the bucket.

Credentials never appear in the config (the config checks refuse ``s3://key:secret@``):
boto3 reads them from the standard AWS variables and files (``AWS_ACCESS_KEY_ID``,
``AWS_PROFILE``, ``AWS_ENDPOINT_URL_S3``, IRSA's web identity token, ...). This module
imports boto3 only in :func:`check`'s probe, so the launcher stays light without it.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import uuid

from train.core.errors import CannotRunHere
from train.core.storage.credentials import redacted
from train.core.storage.urls import RemoteURL, parse

KEY = "checkpoint.remote"
INSTALL = "pip install 'trainpod[s3]' (or pip install boto3; in an image: a RUN line in your " \
          "Dockerfile)"
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
# boto3 >= 1.36 adds a CRC32 trailer to every upload by default ("when_supported"), which
# several S3-compatible stores reject; the remote tier checks SHA-256 itself, so only
# where an operation requires one.
CLIENT_CHECKSUMS = "when_required"
# The data path's client (:func:`shared`): botocore's own retries of one request (a fetch
# is tried again whole on top), and a pool for the cache's ranged GETs, hedges and a HEAD
# (train/data/objectget.py: CONNECTIONS)
DATA_ATTEMPTS = 5
DATA_CONNECTIONS = 12


def endpoint(environ=os.environ) -> str:
    """The endpoint boto3 will use, for messages: the variable's value, or AWS's."""
    for name in ENDPOINT_VARS:
        if environ.get(name):
            return redacted(environ[name])
    return "the AWS default endpoint"


def check(remote: str | None, run_name: str, source: str, environ=os.environ, *,
          probe: bool = True) -> None:
    """Before a launch: boto3 is installed, and (``probe``) the bucket answers and takes a
    write under the run's prefix (a small probe object, deleted again). Exit 3 otherwise."""
    if not remote:
        return
    url, _ = parse(remote)
    if url is None:  # the config checks refused it already
        return
    if importlib.util.find_spec("boto3") is None:
        raise CannotRunHere(f"{source}: {KEY}: {remote} needs boto3, which is not installed "
                            f"here: {INSTALL}; or leave {KEY} empty")
    problem = writable(url, run_name) if probe else None
    if problem:
        raise CannotRunHere(f"{source}: {KEY}: cannot write to bucket {url.bucket} at "
                            f"{endpoint(environ)}: {problem}; check the AWS_* variables "
                            "(docs/object-storage.md)")


def writable(url: RemoteURL, run_name: str) -> str | None:
    """None when a small object can be written and deleted under the run's prefix; else
    the store's answer in one line (no credential in it)."""
    key = f"{url.run_prefix(run_name)}/.probe-{uuid.uuid4().hex}"
    try:
        s3 = client(attempts=2)
        s3.put_object(Bucket=url.bucket, Key=key, Body=b"probe\n")
        s3.delete_object(Bucket=url.bucket, Key=key)
    except errors() as exc:  # whatever the store or the network says
        return said(exc)
    return None


def client(attempts: int = 3, connections: int = 10):
    """A boto3 S3 client from the default credential chain (variables, profile and shared
    files, web identity, instance metadata); ``attempts``: botocore's own retries of one
    request (the remote tier retries whole files on top, with backoff); ``connections``:
    its pool's size, at least the requests its threads make at once (botocore's default:
    10)."""
    import boto3  # only where a remote is configured: the base install has none
    import botocore.config
    config = botocore.config.Config(
        retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=5,
        read_timeout=60, max_pool_connections=connections,
        request_checksum_calculation=CLIENT_CHECKSUMS,
        response_checksum_validation=CLIENT_CHECKSUMS)
    return boto3.session.Session().client("s3", config=config)


def shared(attempts: int = DATA_ATTEMPTS, connections: int = DATA_CONNECTIONS):
    """This process's client for ``attempts`` and ``connections`` (:func:`client`), made
    on first use and kept: the data path's listing, its cache and ``train.data.remote``
    share one, so the cost of making it (0.1-0.35 s on a loaded node: boto3 reads its
    service model and endpoint rules, and the credential chain) is paid once, at the
    listing, before the model is built, and not again by the first batch's fetch. Keyed
    by the process (a client must not cross a fork) and its ``AWS_*`` variables (changed
    ones make a new client, as a new process would)."""
    key = (os.getpid(), attempts, connections,
           tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    with _shared_guard:  # one made, not one per thread that asks at once
        if key not in _shared:
            _shared[key] = client(attempts, connections)
        return _shared[key]


def forget() -> None:
    """Drop the clients :func:`shared` keeps: the next one is made from nothing (as in a
    new process; bench/tokenobjects_link.py measures that)."""
    with _shared_guard:
        _shared.clear()


def _after_fork_in_child() -> None:
    global _shared_guard
    _shared_guard = threading.Lock()  # a thread of the parent may have held it
    _shared.clear()


_shared: dict[tuple, object] = {}
_shared_guard = threading.Lock()
os.register_at_fork(after_in_child=_after_fork_in_child)


def said(exc: BaseException, limit: int = 300) -> str:
    """An exception of boto3 or the network as one short line, with no credential in it."""
    error = (getattr(exc, "response", None) or {}).get("Error") or {}
    text = f"{error.get('Code', '?')}: {error.get('Message') or exc}" if error \
        else str(exc) or type(exc).__name__
    return redacted(" ".join(text.split()))[:limit]


def code(exc: BaseException) -> str | None:
    """The store's error code in ``exc`` (a botocore ClientError's), or None."""
    response = getattr(exc, "response", None) or {}
    return response.get("Error", {}).get("Code")


def missing(exc: BaseException) -> bool:
    """Whether ``exc`` says the object is not there."""
    return code(exc) in ("404", "NoSuchKey", "NotFound")


def errors() -> tuple[type[BaseException], ...]:
    """What a call to the store can raise when the store or the network says no: botocore's
    errors (its ClientError: the store's answer; BotoCoreError: no connection, no
    credentials, a timeout, a body cut off), boto3's own (a managed transfer's failure),
    urllib3's (a body read where botocore does not wrap them) and OSError (the network,
    a local file). Without boto3, OSError alone."""
    try:
        import boto3.exceptions
        import botocore.exceptions
        import urllib3.exceptions
    except ImportError:
        return (OSError,)
    return (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError,
            boto3.exceptions.Boto3Error, urllib3.exceptions.HTTPError, OSError)
