"""The run's lease in object storage (``checkpoint.remote``): one job per remote run.

The run directory's lease (:mod:`train.core.run.runlock`) keeps two jobs from writing one run
only where both see the same directory. With a remote, two jobs on different disks (a
node-local run directory on Kubernetes, two clusters given one bucket, a colleague's run
of the same name) would both upload to ``PREFIX/RUN_NAME`` and each resume from the
other's checkpoints. So the launcher also holds ``PREFIX/RUN_NAME/lease.json``: the same
record as the local lease (job, host, pid, renewals), judged by the same rules (members of
one job share it; another job's live lease is waited for up to ``run.lock_wait_s``, then
exit 6; a lease not renewed for ``run.lock_expiry_s``, or of a job known to have ended, is
taken over, saying whose), renewed every ``run.lock_renew_s`` by a thread of the launcher.

A store that cannot be read or written here is not a reason to stop: the launcher
checked the bucket a moment before, the local lease still guards the run directory, and
the remote tier says so when it cannot upload. One warning, and no remote lease.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from train.core.errors import RunDirBusy
from train.core.run import runlock
from train.core.run.runlock import LeaseTimes
from train.core.storage import s3 as store
from train.core.storage.urls import parse

NAME = "lease.json"
LOGGED_EVERY_S = 15
# The most a release waits for the store: it runs as the launcher ends, often after a
# stop signal, within the platform's grace period; a lease not marked released expires.
RELEASE_WAIT_S = 5.0


class RemoteLease:
    """Held while the job runs: renewed by a thread until :meth:`release`."""

    def __init__(self, s3, bucket: str, key: str, job: str, times: LeaseTimes,
                 log: Callable[[str], None]):
        self.s3, self.bucket, self.key, self.job, self.times = s3, bucket, key, job, times
        self.log, self.lost = log, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="remote-lease", daemon=True)

    @property
    def where(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def read(self) -> dict:
        try:
            data = self.s3.get_object(Bucket=self.bucket, Key=self.key)["Body"].read()
        except store.errors() as exc:  # re-raised unless it says "not there"
            if store.missing(exc):
                return {}
            raise
        try:
            found = json.loads(data.decode("utf-8", errors="replace"))
        except ValueError:
            return {}
        return found if isinstance(found, dict) else {}

    def write(self, previous: dict, released: bool = False) -> None:
        body = json.dumps(runlock.record(self.job, previous, released)).encode()
        self.s3.put_object(Bucket=self.bucket, Key=self.key, Body=body)

    def _renew(self) -> None:
        while not self._stop.wait(self.times.renew_s):
            try:
                holder = self.read()
                if holder.get("job") not in (None, self.job):
                    self.lost = True
                    self.log(f"warning: {self.where} was taken over by job {holder.get('job')} "
                             f"({runlock.who(holder)}): this job's renewals did not reach the "
                             f"store for {self.times.expiry_s:.0f} s; the two jobs now share "
                             "the remote checkpoints")
                    return
                self.write(holder)
            except store.errors():  # the store is away: the next renewal tries again
                continue

    def release(self, wait_s: float = RELEASE_WAIT_S) -> None:
        """Marked released (other members of the job, still running, renew it again),
        waiting at most ``wait_s`` for the store (each of its calls may take a minute)."""
        self._stop.set()
        marking = threading.Thread(target=self._mark_released, name="remote-lease-release",
                                   daemon=True)
        marking.start()
        marking.join(wait_s)

    def _mark_released(self) -> None:
        if self._thread.is_alive():
            self._thread.join()  # a renewal under way lands first
        if self.lost:
            return
        try:
            holder = self.read()
            if holder.get("job") == self.job:
                self.write(holder, released=True)
        except store.errors():  # the lease expires by itself
            pass


def acquire(url: str, run_name: str, job: str, times: LeaseTimes,
            log: Callable[[str], None], ended: Callable[[str], bool] | None = None,
            s3=None) -> RemoteLease | None:
    """The remote run's lease for ``job``, waiting for another job's live one up to
    ``times.wait_s`` (then RunDirBusy, exit 6); None when the store does not answer."""
    parsed, _ = parse(url)
    if parsed is None:
        return None
    key = f"{parsed.run_prefix(run_name)}/{NAME}"
    try:
        lease = RemoteLease(s3 or store.client(attempts=2), parsed.bucket, key, job,
                            times, log)
        return _take(lease, ended)
    except RunDirBusy:
        raise
    except store.errors() as exc:
        log(f"warning: the remote run lease {parsed}/{key} could not be read or written "
            f"({store.said(exc)}); going on with the local lease only")
        return None


def _take(lease: RemoteLease, ended: Callable[[str], bool] | None) -> RemoteLease:
    watch, deadline, said = runlock.Watch(), time.monotonic() + lease.times.wait_s, -1e9
    while True:
        holder = lease.read()
        verdict = runlock.lease_verdict(holder, lease.job, lease.times, watch,
                                        local_busy=False, ended=ended)
        if verdict != "live":
            if verdict in ("expired", "dead", "ended"):
                lease.log(f"taking over the remote run {lease.where} from job "
                          f"{holder.get('job')} ({runlock.who(holder)}; {runlock.age(holder)})")
            lease.write(holder if verdict == "member" else {})
            if lease.read().get("job") == lease.job:  # two jobs at once: the last write won
                lease._thread.start()
                return lease
            continue
        now = time.monotonic()
        if now >= deadline:
            raise RunDirBusy(f"the remote run {lease.where} is in use by job "
                             f"{holder.get('job')} ({runlock.who(holder)}; "
                             f"{runlock.age(holder)}), still after {lease.times.wait_s:.0f} s "
                             "(run.lock_wait_s): two jobs must not write the same run; wait "
                             "for it to finish, stop it, or choose another run.name or "
                             "checkpoint.remote prefix")
        if now - said >= LOGGED_EVERY_S:
            lease.log(f"waiting up to {deadline - now:.0f} s for the remote run {lease.where}: "
                      f"in use by job {holder.get('job')} ({runlock.who(holder)}; "
                      f"{runlock.age(holder)})")
            said = now
        time.sleep(min(1.0, lease.times.renew_s / 2))

