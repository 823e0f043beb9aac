"""One object's bytes into a local file, as ranged GETs on several connections at once.

Why not one GET: on a link with a round trip of tens of milliseconds one TCP stream is
bound by its window, and one Python thread reading it stalls the stream at each pause
(a loaded node); an object split over :data:`IN_FLIGHT` connections keeps the link full
(docs/object-storage.md, "Over a real link"). Why not boto3's ``download_file``, which
splits too: it checks nothing against the listing the run started from, and an object
replaced between its ranges would land as a mix of both.

Every GET names the ETag the run listed (``If-Match``): a range asked after the object
was replaced is refused by the store (412), and each answer's ETag and total size are
checked too, for a store that ignores the condition. Either is
:class:`~train.core.errors.DataChanged`, one line naming the object. The bytes are then
checked against the size and, where the ETag is one (a single-part upload), the MD5 of
the whole object, read back from the file in order as its parts land; a mismatch is
:class:`DamagedInTransit`, which the caller fetches again.

A range that lags far behind the object's others is asked for again, with the same
``If-Match``, and the first whole answer is the one in the file (:mod:`.hedging`: when,
and why then). A range whose request fails is not asked again on its own: the fetch
fails, and the caller fetches the object again.

The ranged GETs of all the objects a process fetches at once share one set of
:data:`IN_FLIGHT` threads (daemon threads: a DataLoader worker forked later makes its
own), a hedge a thread of its own; the caller's boto3 client needs a connection pool of
:data:`CONNECTIONS`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable

from train.core.datasets.tokenfiles import TokenFile
from train.core.errors import DataChanged
from train.core.storage.s3 import errors as storage_errors
from train.data.hedging import HEDGE_FLOOR_S, HEDGES, Range, Stopped, due, median_took

log = logging.getLogger("train")
PART = 8 << 20       # the most bytes of one ranged GET
MIN_PART = 2 << 20   # the least; an object under two of them is one GET
IN_FLIGHT = 8        # ranged GETs under way at once in one process, all objects together
CONNECTIONS = IN_FLIGHT + HEDGES + 2  # the least connection pool a caller's client needs
READ = 1 << 20       # bytes taken from an answer's stream at a time
PLAIN_MD5 = re.compile(r"^[0-9a-f]{32}$")  # a multipart upload's ETag is not the MD5
CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")

# What the user can do about data that changed under a run.
CHANGED = ("; a run trains on the data it started with: put the object back as it was, or "
           "start a new run (another run.name) on the new data")


class DamagedInTransit(OSError):
    """The bytes received are not the object's (the store said it was unchanged): fetched
    again."""


def parts(size: int) -> list[tuple[int, int]]:
    """The byte ranges ``[start, end)`` an object of ``size`` bytes is fetched in: one
    for a small object, else at least :data:`IN_FLIGHT` (while parts stay above
    :data:`MIN_PART`) and none over :data:`PART`."""
    if size < 2 * MIN_PART:
        return [(0, size)]
    n = max(-(-size // PART), min(IN_FLIGHT, size // MIN_PART))
    step = -(-size // n)
    return [(start, min(start + step, size)) for start in range(0, size, step)]


class _Pool:
    """:data:`IN_FLIGHT` daemon threads taking jobs in the order they came, and the
    :data:`HEDGES` slots of the hedges (each on a thread of its own: a hedge queued
    behind the next object's ranges would come too late)."""

    def __init__(self) -> None:
        self.pid, self.jobs = os.getpid(), queue.SimpleQueue()
        self.hedges = threading.BoundedSemaphore(HEDGES)
        for i in range(IN_FLIGHT):
            threading.Thread(target=self._work, name=f"data-fetch-{i}", daemon=True).start()

    def submit(self, fn: Callable[[], int]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((future, fn))
        return future

    def _work(self) -> None:
        while True:
            future, fn = self.jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the thread that waits for it
                    future.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise  # the interpreter's own (SystemExit, ...): this thread ends


_pool: _Pool | None = None
_pool_guard = threading.Lock()


def _threads() -> _Pool:
    global _pool
    with _pool_guard:
        if _pool is None or _pool.pid != os.getpid():  # a fork's child has no threads
            _pool = _Pool()
        return _pool


def same_as_listed(f: TokenFile, size: int | None, etag: str) -> None:
    """The store's object is the one the run listed (its size and ETag), else DataChanged."""
    if (size is not None and size != f.size) or (etag and f.etag and etag != f.etag):
        raise DataChanged(f"{f.name}: changed in the store since the run listed it (size "
                          f"{f.size} -> {size}, ETag {f.etag} -> {etag}){CHANGED}")


def fetch_into(s3, f: TokenFile, fd: int) -> int:
    """Write the object ``f`` into the open file ``fd`` (boto3 client ``s3``); the bytes
    written, checked as the module says. Returns once no thread writes to ``fd`` any more
    (a request that lost to its hedge may still be reading its answer: it writes nothing)."""
    ranges = [Range(start, end) for start, end in parts(f.size)]
    stop, pool = threading.Event(), _threads()
    get = functools.partial(_request, s3, f, fd, ranged=len(ranges) > 1, stop=stop)
    for r in ranges:
        r.outstanding = 1
        pool.submit(functools.partial(get, r, hedge=False))
    md5 = hashlib.md5(usedforsecurity=False) if PLAIN_MD5.match(f.etag) else None
    size = 0
    try:
        for r in ranges:
            _wait_hedging(f, r, ranges, lambda late: _hedge(pool, get, late))
            size += r.done.result()
            start = r.start
            while md5 is not None and start < r.end:  # hashed in order, as the parts land
                chunk = os.pread(fd, min(READ, r.end - start), start)
                md5.update(chunk)
                start += len(chunk)
    finally:
        stop.set()  # the requests not begun are not made; those under way stop early
        for r in ranges:
            r.close()  # a chunk being written lands; none is written after
    if md5 is not None and md5.hexdigest() != f.etag:
        raise DamagedInTransit(f"{f.name}: the bytes' MD5 {md5.hexdigest()} is not the "
                               f"store's ETag {f.etag}")
    return size


def _request(s3, f: TokenFile, fd: int, r: Range, *, ranged: bool, stop: threading.Event,
             hedge: bool) -> None:
    """One GET of ``r``: the first request writes into ``fd`` as its answer arrives; a
    hedge holds its answer (at most :data:`PART` bytes) and writes it only if it is the
    first whole one."""
    me, began, got, failure, held = object(), time.monotonic(), 0, None, []

    def keep(chunk: bytes, at: int) -> None:
        with r.lock:
            if stop.is_set() or not r.writable(me):
                raise Stopped
            if hedge:
                held.append(chunk)
            else:
                os.pwrite(fd, chunk, at)

    def land() -> None:
        at = r.start
        for chunk in held:
            os.pwrite(fd, chunk, at)
            at += len(chunk)
    with r.lock:
        r.began = r.began or began
    try:
        if stop.is_set():  # another range failed: this one is not needed any more
            raise Stopped
        got = _part(s3, f, r.start, r.end, ranged, keep)
        if got != r.end - r.start:
            raise DamagedInTransit(f"{f.name}: fetched {got} bytes of {r.end - r.start} at "
                                   f"byte {r.start} (an object of {f.size})")
    except (Stopped, DataChanged, *storage_errors()) as exc:  # the range's outcome
        failure = exc
    except BaseException as exc:  # anything else ends the range too, and goes on up
        r.end_of(me, got, exc, time.monotonic() - began, None)
        raise
    r.end_of(me, got, failure, time.monotonic() - began, land if hedge else None)


def _wait_hedging(f: TokenFile, r: Range, ranges: list[Range],
                  hedge: Callable[[Range], bool]) -> None:
    """Wait for ``r``; meanwhile ask again for any range of the object that lags
    (:func:`.hedging.due`)."""
    while not r.done.done():
        now = time.monotonic()
        late, wake = due(ranges, now)
        for x in late:
            if hedge(x):
                log.info("fetching %s: bytes %d-%d still arriving after %.2f s (the others "
                         "took %.2f s): asked again", f.name, x.start, x.end - 1,
                         now - x.began, median_took(ranges))
            else:  # every hedge slot in use: look again soon
                wake = HEDGE_FLOOR_S if wake is None else min(wake, HEDGE_FLOOR_S)
        concurrent.futures.wait([x.done for x in ranges if not x.done.done()], wake,
                                return_when=concurrent.futures.FIRST_COMPLETED)


def _hedge(pool: _Pool, get: Callable, r: Range) -> bool:
    """Ask for ``r`` again on a thread of its own; False when :data:`HEDGES` are under way."""
    if not pool.hedges.acquire(blocking=False):
        return False
    with r.lock:
        r.hedged = True
        if r.done.done():  # it arrived meanwhile
            pool.hedges.release()
            return True
        r.outstanding += 1

    def run() -> None:
        try:
            get(r, hedge=True)
        finally:
            pool.hedges.release()
    threading.Thread(target=run, name="data-fetch-hedge", daemon=True).start()
    return True


def _part(s3, f: TokenFile, start: int, end: int, ranged: bool,
          keep: Callable[[bytes, int], None]) -> int:
    """One GET of ``f``'s bytes ``[start, end)``, each chunk handed to ``keep`` with its
    offset; the bytes received."""
    bucket, key = f.bucket_key()
    ask = {"Bucket": bucket, "Key": key}
    if f.etag:
        ask["IfMatch"] = f'"{f.etag}"'
    if ranged:
        ask["Range"] = f"bytes={start}-{end - 1}"
    from botocore.exceptions import ClientError  # boto3's: only with the s3 extra
    try:
        got = s3.get_object(**ask)
    except ClientError as exc:  # the store's refusal: If-Match failed when it changed
        if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
            _changed(s3, f)
        raise
    etag = got.get("ETag", "").strip('"')
    if ranged:
        span = CONTENT_RANGE.match(got.get("ContentRange") or "")
        if span is None or (int(span[1]), int(span[2])) != (start, end - 1):
            same_as_listed(f, int(span[3]) if span else None, etag)
            raise DamagedInTransit(f"{f.name}: asked for bytes {start}-{end - 1}, the store "
                                   f"answered {got.get('ContentRange')!r}")
        same_as_listed(f, int(span[3]), etag)
    else:
        same_as_listed(f, got.get("ContentLength"), etag)
    received = 0
    with got["Body"] as body:
        for chunk in iter(lambda: body.read(READ), b""):
            keep(chunk, start + received)
            received += len(chunk)
    return received


def _changed(s3, f: TokenFile) -> None:
    """The store refused a GET for ``f``'s listed ETag: DataChanged naming what it holds
    now (a HEAD; gone: the caller's "no longer in the store")."""
    bucket, key = f.bucket_key()
    now = s3.head_object(Bucket=bucket, Key=key)
    same_as_listed(f, now.get("ContentLength"), now.get("ETag", "").strip('"'))
    raise DamagedInTransit(f"{f.name}: the store refused its listed ETag {f.etag}, then "
                           "named it again")  # replaced and put back: fetched again
