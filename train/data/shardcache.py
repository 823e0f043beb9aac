"""Token files in object storage, fetched whole into a bounded local folder.

A ``data.kind: tokens`` dataset may name ``s3://`` objects (:mod:`train.core.datasets.tokenfiles`
lists them). Training reads them from local copies: each object is fetched once, whole,
into ``data.cache_dir`` (node-local by default), where every process of the node finds
it: the ranks, their DataLoader workers, and the next start of the run. A per-object
``flock`` makes one process fetch while the others wait for it (the kernel drops the
lock of a process that dies mid-fetch; its partial file is never renamed into place).

What was fetched is checked against the listing the run started from. The store's
answer to the fetch names the object's size and ETag as they are now: when they differ
from the listing, or the object is gone, the data changed under the run, which is
:class:`~train.core.errors.DataChanged` (one line naming the object, exit 2, not
restarted: a restart would list the new data and train on it). The bytes are then
checked against the size, and the MD5 where the ETag is one (a single-part upload): a
mismatch there is damage in transit, fetched again, and after :data:`ATTEMPTS` one line
naming the object, never silently different data. When the folder
would grow past ``data.cache_bytes`` the least recently used files go first; a process
reading an evicted file fetches it again. Why whole files and not byte ranges, and what
a cache smaller than the dataset costs: docs/object-storage.md ("Training data").

An object of a few MiB or more is fetched as ranged GETs on several connections at once,
each conditional on the listed ETag (:mod:`.objectget`), into a hidden part file renamed
into place once whole and checked; a range that lags far behind the others is asked for
again (:mod:`.hedging`). The client is boto3 (:func:`train.core.storage.s3.shared`,
credentials the AWS way): the one the listing made, once per process (a boto3 client
must not cross a fork into a DataLoader worker).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from train.core.datasets.tokenfiles import TokenFile
from train.core.errors import DataChanged
from train.data import objectget
from train.data.objectget import CHANGED

log = logging.getLogger("train")

ATTEMPTS = 3     # fetches of one object before its read fails
# Objects a read-ahead fetches at once, in order: the next one's first ranges are asked
# while the last ranges of the one before arrive (one at a time, each object's first
# round trip and its slowest range leave the link idle: docs/object-storage.md)
AT_ONCE = 2


class DataFileError(RuntimeError):
    """A data file that cannot be fetched: one line naming it."""


# Bytes of objects fetched whole by this process and the DataLoader workers it forks after
# count_fetches(): an integer in shared memory, so a worker's fetches count in its rank's
# total (None: not counting; a worker started by spawn inherits none and counts nothing).
_fetched = None


def count_fetches() -> Callable[[], int]:
    """Count from now on the bytes this process, and the workers it forks later, fetch
    from the store (the metric ``data/fetched_bytes``); returns the count's reader."""
    global _fetched
    if _fetched is None:
        import multiprocessing  # here: 20 ms, for runs that read objects only
        _fetched = multiprocessing.Value("q", 0)
    return fetched_bytes


def fetched_bytes() -> int:
    """Bytes fetched since :func:`count_fetches` (0 before)."""
    return 0 if _fetched is None else _fetched.value


def _counted(size: int) -> None:
    if _fetched is not None:
        with _fetched.get_lock():  # a process-shared semaphore: a fork cannot strand it
            _fetched.value += size


def default_folder() -> Path:
    return Path(tempfile.gettempdir()) / "trainpod-data"


def cache_name(f: TokenFile) -> str:
    """The local name of an object: its URL and ETag hashed (a replaced object is a new
    file), then its own name for a reader of the folder."""
    tag = hashlib.sha256(f"{f.name}\0{f.etag}".encode()).hexdigest()[:16]
    return f"{tag}-{f.name.rpartition('/')[2]}"


# The lock files this process holds open. A flock belongs to the open file, which a
# fork shares: a DataLoader worker forked while the read-ahead thread held an object's
# lock would keep that lock after the thread let go, and wait for it itself forever.
# The child closes its copies at once; the fork waits while a lock is being opened.
_lock_files: set[int] = set()
_lock_files_guard = threading.Lock()


def _forget_inherited_locks() -> None:
    for fd in _lock_files:
        with contextlib.suppress(OSError):
            os.close(fd)
    _lock_files.clear()
    _lock_files_guard.release()  # taken by the forking thread, this process's only one


# Held while a thread makes this process's client (a fork's child gets a new one)
_client_guard = threading.Lock()


def _new_client_guard() -> None:
    global _client_guard
    _client_guard = threading.Lock()


os.register_at_fork(after_in_child=_new_client_guard)
os.register_at_fork(before=_lock_files_guard.acquire,
                    after_in_parent=_lock_files_guard.release,
                    after_in_child=_forget_inherited_locks)


@contextlib.contextmanager
def object_lock(path: Path) -> Iterator[None]:
    """Held while one process (or thread) of the node fetches an object; the others wait
    (the kernel drops the lock of a process that dies)."""
    with _lock_files_guard:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        _lock_files.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with _lock_files_guard:
            _lock_files.discard(fd)
            os.close(fd)


class ShardCache:
    """A folder of fetched objects, at most ``limit`` bytes (see the module's docstring)."""

    def __init__(self, folder: Path, limit: int):
        self.folder, self.limit = Path(folder), limit
        self._client: tuple[int, object] | None = None
        # (pid, name) -> size of the objects this process's threads are fetching: room is
        # made for them too (keyed by pid: a forked child does not count its parent's)
        self._arriving: dict[tuple[int, str], int] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_client": None, "_arriving": {}}

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
        with object_lock(self.folder / f".{path.name}.lock"):  # another may be fetching it
            if not path.exists():
                arriving = (os.getpid(), path.name)
                self._arriving[arriving] = f.size
                try:
                    self._make_room(f.size, but=arriving)
                    self._fetch(f, path)
                finally:
                    del self._arriving[arriving]  # counted from now on as a file
        return path

    def _s3(self):
        """This process's boto3 client for data (a client must not cross a fork): the one
        the listing made (:func:`train.core.storage.s3.shared`), its connection pool
        sized for the ranged GETs of :mod:`.objectget`."""
        from train.core.storage.s3 import shared
        with _client_guard:
            if self._client is None or self._client[0] != os.getpid():
                self._client = (os.getpid(), shared())
            return self._client[1]

    def _fetch(self, f: TokenFile, path: Path) -> None:
        """Fetch ``f`` into ``path``; a connection that fails mid-way is tried again
        (botocore retries a request, not a body cut off while it streams)."""
        from train.core.storage.s3 import errors, missing, said
        for attempt in range(1, ATTEMPTS + 1):
            try:
                size = self._fetch_once(f, path)
                break
            except DataChanged:
                raise
            except errors() as exc:  # the store's or the network's answer, in one line
                if missing(exc):
                    raise DataChanged(f"{f.name}: no longer in the store (it was listed when "
                                      f"the run started){CHANGED}") from None
                if attempt == ATTEMPTS:
                    raise DataFileError(f"{f.name}: cannot fetch ({ATTEMPTS} attempts): "
                                        f"{said(exc)}") from None
                log.warning("fetching %s: %s; trying again", f.name, said(exc))
                time.sleep(attempt)
        _counted(size)
        log.info("fetched %s (%d bytes) into %s", f.name, size, self.folder)

    def _fetch_once(self, f: TokenFile, path: Path) -> int:
        part = path.with_name(f".{path.name}.{os.getpid()}.part")  # hidden from readers
        try:
            with open(part, "w+b") as out:  # read back for its MD5
                size = objectget.fetch_into(self._s3(), f, out.fileno())
            os.replace(part, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                part.unlink()
        return size

    def _make_room(self, need: int, but: tuple[int, str]) -> None:
        """Remove the least recently used files until ``need`` more bytes fit beside the
        other objects this process is fetching (all but ``but``)."""
        pid = os.getpid()
        need += sum(size for (p, name), size in list(self._arriving.items())
                    if p == pid and (p, name) != but)
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

    def fetch_ahead(self, f: TokenFile) -> bool:
        """Fetch ``f`` ahead of its reader; False when it cannot be fetched (its reader
        says why, in its own step)."""
        try:
            self.local(f)
        except (DataFileError, DataChanged):
            return False
        return True

    def fetch_all_ahead(self, files: Iterable[TokenFile]) -> bool:
        """Fetch ``files`` ahead of their readers, in this order, :data:`AT_ONCE` at a
        time; False once one cannot be fetched (no later one is begun)."""
        todo, guard, failed = iter(files), threading.Lock(), []

        def work() -> None:
            while not failed:
                with guard:  # files may be a generator: one thread at a time in it
                    f = next(todo, None)
                if f is None:
                    return
                if not self.fetch_ahead(f):
                    failed.append(f)
        threads = [threading.Thread(target=work, name="data-read-ahead", daemon=True)
                   for _ in range(AT_ONCE)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return not failed

    def read_ahead(self, files: Iterable[TokenFile]) -> threading.Thread:
        """Fetch ``files`` in this order in the background, as many as the cache holds."""
        def within_budget() -> Iterator[TokenFile]:
            budget = self.limit
            for f in files:
                budget -= f.size
                if budget < 0:
                    return
                yield f
        thread = threading.Thread(target=lambda: self.fetch_all_ahead(within_budget()),
                                  name="data-read-ahead", daemon=True)
        thread.start()
        return thread
