"""One run directory, one writer: a lock taken before training writes to it.

Two launches of the same run (the same ``output.dir/run.name``) would interleave their
checkpoints, metrics and config; the second one must fail at once, naming the holder.
The lock is ``RUN_DIR/.lock``, held with ``flock`` by the process that runs the job
(the launcher, or a worker started without it) and inherited by its direct child. The
kernel releases it when the last holder dies, however it dies, so a stale lock is
simply taken over. The file holds a JSON record of the holder (job, host, pid, start)
for the message.

A multi-node job shares its run directory legitimately: a node whose job id (the
rendezvous id) matches the holder's record goes ahead without holding the lock.

Where the file system refuses ``flock``, the record serves as a lease: a holder on this
host counts while its process lives; one on another host counts until its file is
removed, which the message says.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from train.core.errors import CannotRunHere, ConfigError
from train.core.files import LinkRefused, refusing_links, write_atomic
from train.core.host import process_alive

LOCK_FILE = ".lock"


@dataclass
class RunLock:
    """The lock, while held (``fd`` open); ``fd`` is None when another node of the same
    job holds it, or when the file system only allowed a lease."""
    path: Path
    fd: int | None
    job: str
    lease: bool = False

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.lease and _read(self.path).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
            self.lease = False


def acquire(run_dir: Path, job: str | None = None) -> RunLock:
    """Lock ``run_dir`` for ``job`` (None: this launch alone); CannotRunHere (exit 3)
    naming the holder when another job has it."""
    job = job or f"launch-{uuid.uuid4().hex[:12]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    try:
        fd = refusing_links(path, os.O_RDWR | os.O_CREAT, 0o664)
    except LinkRefused as exc:
        raise ConfigError(str(run_dir), LOCK_FILE, exc.strerror) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _read(path)
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            if holder.get("job") == job:
                return RunLock(path, None, job)  # another node of this job holds it
            raise CannotRunHere(_held_message(run_dir, holder)) from None
        return _lease(path, run_dir, job, holder)  # no flock on this file system
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(_record(job)).encode())
    os.fsync(fd)
    return RunLock(path, fd, job)


def _record(job: str) -> dict:
    return {"job": job, "host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _held_message(run_dir: Path, holder: dict) -> str:
    who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since "
           f"{holder.get('started', '?')}") if holder else "another process"
    return (f"run directory {run_dir} is in use by {who}: two runs must not write the same "
            "run; wait for it to finish, stop it, or choose another run.name")


def _lease(path: Path, run_dir: Path, job: str, holder: dict) -> RunLock:
    """The record alone, for file systems without flock."""
    if holder and holder.get("job") != job:
        here = holder.get("host") == socket.gethostname()
        if not here or process_alive(holder.get("pid")):
            hint = "" if here else (f"; if that run is gone, remove {path}")
            raise CannotRunHere(_held_message(run_dir, holder) + hint)
    write_atomic(path, json.dumps(_record(job)))
    return RunLock(path, None, job, lease=True)
