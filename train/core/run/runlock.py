"""One run directory, one job: a lease taken before training writes to it.

Two jobs writing the same run (the same ``output.dir/run.name``) would interleave their
checkpoints, metrics and config. On Kubernetes and SLURM the run directory lives on
shared storage (an RWX volume, NFS, Lustre), where a lock held by a process is
invisible to other hosts and a dead host's lock is never released. So the lock is a
**lease**, ``RUN_DIR/.lock``, a small JSON record (job, host, pid, when it was taken
and last renewed, a renewal count) that:

- every process of the job that holds it renews every ``run.lock_renew_s`` seconds,
  replacing the file by rename (never truncating it in place: a reader sees the old
  record or the new one, never an empty one);
- is **shared by the members of one job** (the same rendezvous id): they never refuse
  each other, however many start at the same instant;
- makes a launch of another job **wait** (up to ``run.lock_wait_s``, saying who holds it)
  while it is live: a re-created Job whose old pod is still writing its SIGTERM
  checkpoint simply waits for it; after the wait, :class:`~train.core.errors.RunDirBusy`
  (exit 6, which a platform may retry);
- counts as **expired** once ``run.lock_expiry_s`` passed without a renewal (read from the
  record's time, and from watching its renewal count not move): then another host takes
  it over, saying whose lease and how old. A holder on this host that no longer exists
  is taken over at once, and so is a job the caller knows has ended (a requeued SLURM
  job's earlier incarnation: SLURM starts the next one only after it).

On this host the holder also keeps ``RUN_DIR/.flock`` locked with ``flock``, inherited by
its child processes, so that while any process of a run lives (a worker still writing its
checkpoint after its launcher died) no other launch here takes the run over. Where the file
system refuses ``flock`` the lease alone decides. Times across hosts assume clocks within a
few seconds of each other (NTP); the renewal count covers a larger skew at the cost of a
wait of ``run.lock_expiry_s``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from train.core.errors import ConfigError, RunDirBusy
from train.core.files import LinkRefused, refusing_links, write_atomic
from train.core.machine.host import process_alive
from train.core.run import rundir

LOCK_FILE = rundir.LOCK
FLOCK_FILE = rundir.FLOCK


class LeaseTimes(NamedTuple):
    """The run.lock_* keys, in seconds."""
    renew_s: float = 10
    expiry_s: float = 60
    wait_s: float = 300

    @classmethod
    def of(cls, cfg) -> LeaseTimes:
        return cls(cfg.run.lock_renew_s, cfg.run.lock_expiry_s, cfg.run.lock_wait_s)


DEFAULT_TIMES = LeaseTimes()


@dataclass
class RunLock:
    """The lease of one job, while held: renewed by a thread until :meth:`release`."""
    path: Path
    job: str
    times: LeaseTimes
    fd: int | None = None                # the flock, inherited by this process's children
    lost: str | None = None              # set when another job took the lease over
    on_lost: Callable[[str], None] | None = None
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew, name="run-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.times.renew_s):
            holder = read(self.path)
            if holder.get("job") not in (None, self.job):
                self.lost = (f"the run directory {self.path.parent} was taken over by job "
                             f"{holder.get('job')} ({who(holder)}): this job's renewals "
                             f"were not seen for {self.times.expiry_s:.0f} s (cut off from "
                             "the shared storage?); stopped without writing more")
                if self.on_lost:
                    self.on_lost(self.lost)
                return
            try:
                write(self.path, self.job, holder)
            except OSError:
                continue  # the storage is away: the next renewal tries again
            if self.fd is None:  # the member that held it here has left: hold it now
                self.fd = _flock(self.path.parent)

    def release(self) -> None:
        """Mark the lease released (not removed: other members of the job, still running,
        renew it again within run.lock_renew_s) and drop the flock."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        holder = read(self.path)
        if self.lost is None and holder.get("job") == self.job:
            try:
                write(self.path, self.job, holder, released=True)
            except OSError:
                pass  # the lease expires by itself
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def acquire(run_dir: Path, job: str | None = None, times: LeaseTimes = DEFAULT_TIMES,
            log: Callable[[str], None] | None = None,
            on_lost: Callable[[str], None] | None = None,
            ended: Callable[[str], bool] | None = None) -> RunLock:
    """The lease of ``run_dir`` for ``job`` (None: this launch alone), waiting for another
    job's live lease up to ``times.wait_s``; RunDirBusy (exit 6) when it stays held.
    ``ended``: which other jobs are known to be over (a requeued job's earlier
    incarnations): their lease is taken over at once, unless a process of theirs on
    this host still holds the flock."""
    job = job or f"launch-{uuid.uuid4().hex[:12]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = _flock(run_dir)
    watch = Watch()
    deadline = time.monotonic() + times.wait_s
    said = -1.0
    starting = time.monotonic() + 5  # a launch here between its flock and its lease
    while True:
        holder = read(path)
        if not holder and fd is None and time.monotonic() < starting:
            time.sleep(0.02)  # it writes its lease in a moment: a member, or another job
            fd = _flock(run_dir)
            continue
        verdict = lease_verdict(holder, job, times, watch, local_busy=fd is None, ended=ended)
        if verdict in ("free", "member", "expired", "dead", "ended"):
            if verdict in ("expired", "dead", "ended") and log:
                log(f"taking over the run directory {run_dir} from job {holder.get('job')} "
                    f"({who(holder)}; {age(holder)}"
                    f"{'; an earlier incarnation of this job' if verdict == 'ended' else ''})")
            write(path, job, holder if verdict == "member" else {})
            time.sleep(0.05)  # two launches that wrote at once: the last rename won
            if read(path).get("job") == job:
                fd = fd if fd is not None else _flock(run_dir)
                lock = RunLock(path, job, times, fd=fd, on_lost=on_lost)
                lock.start_renewing()
                return lock
            continue
        now = time.monotonic()
        if now >= deadline:
            if fd is not None:
                os.close(fd)
            raise RunDirBusy(f"run directory {run_dir} is in use by job {holder.get('job')} "
                             f"({who(holder)}; {age(holder)}), still after "
                             f"{times.wait_s:.0f} s (run.lock_wait_s): two jobs must not write "
                             "the same run; wait for it to finish, stop it, or choose another "
                             "run.name")
        if log and now - said >= 15:
            log(f"waiting up to {deadline - now:.0f} s for the run directory {run_dir}: in use "
                f"by job {holder.get('job')} ({who(holder)}; {age(holder)}"
                f"{'; a process of it on this host is still running' if fd is None else ''})")
            said = now
        time.sleep(min(1.0, times.renew_s / 2))
        if fd is None:
            fd = _flock(run_dir)


class Watch:
    """When this process last saw another job's lease change (its renewal count)."""

    def __init__(self) -> None:
        self.seen: tuple | None = None
        self.since = time.monotonic()

    def unchanged_for(self, holder: dict) -> float:
        key = (holder.get("job"), holder.get("nonce"), holder.get("renewals"))
        if key != self.seen:
            self.seen, self.since = key, time.monotonic()
        return time.monotonic() - self.since


def lease_verdict(holder: dict, job: str, times: LeaseTimes, watch: Watch, local_busy: bool,
             ended: Callable[[str], bool] | None = None) -> str:
    """free | member | ended | expired | dead | live, for a lease record as read."""
    if not holder:
        return "live" if local_busy else "free"
    if holder.get("job") == job:
        return "member"
    if local_busy:  # a process of another run on this host still holds .flock
        return "live"
    if ended is not None and ended(str(holder.get("job"))):
        return "ended"
    if holder.get("released"):  # free, unless members still running renew it again
        here = holder.get("host") == socket.gethostname()
        return "free" if here or _since_renewed(holder) > 2 * times.renew_s else "live"
    if holder.get("host") == socket.gethostname():
        return "live" if process_alive(holder.get("pid")) else "dead"
    if _since_renewed(holder) > times.expiry_s or watch.unchanged_for(holder) > times.expiry_s:
        return "expired"
    return "live"


def _since_renewed(holder: dict) -> float:
    renewed = holder.get("renewed")
    return time.time() - renewed if isinstance(renewed, (int, float)) else float("inf")


def _flock(run_dir: Path) -> int | None:
    """An exclusive flock on RUN_DIR/.flock, or None while another process holds it. On
    file systems without flock, a descriptor without the lock (the lease decides)."""
    try:
        fd = refusing_links(run_dir / FLOCK_FILE, os.O_RDWR | os.O_CREAT, 0o664)
    except LinkRefused as exc:
        raise ConfigError(str(run_dir), FLOCK_FILE, exc.strerror) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            return None
    return fd


def read(path: Path) -> dict:
    try:
        fd = refusing_links(path, os.O_RDONLY)
    except LinkRefused as exc:
        raise ConfigError(str(path.parent), path.name, exc.strerror) from None
    except OSError:
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            data = json.loads(f.read(65536).decode("utf-8", errors="replace"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write(path: Path, job: str, previous: dict, released: bool = False) -> None:
    write_atomic(path, json.dumps(record(job, previous, released)), durable=False,
                 shared=True)


def record(job: str, previous: dict, released: bool = False) -> dict:
    """The lease for ``job``: renewed (count + 1) when ``previous`` is this job's record."""
    ours = previous.get("job") == job
    return {"job": job, "host": socket.gethostname(), "pid": os.getpid(),
            "started": previous.get("started") if ours else time.time(),
            "renewed": time.time(), "renewals": (previous.get("renewals", 0) + 1) if ours
            else 0, "nonce": previous.get("nonce") if ours else uuid.uuid4().hex,
            **({"released": True} if released else {})}


def who(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"


def age(holder: dict) -> str:
    renewed = holder.get("renewed")
    if not isinstance(renewed, (int, float)):
        return "never renewed"
    return f"renewed {max(0.0, time.time() - renewed):.0f} s ago"
