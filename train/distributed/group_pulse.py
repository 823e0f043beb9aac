"""The ranks of one replica group watching each other, so that a rank that froze
(SIGSTOP, a node that hangs), was cut off or vanished with its node costs its own group
a restart, not every group a timeout.

The Lighthouse hears a group through its rank 0's Manager alone. When another rank of
the group freezes or vanishes, nothing closes: rank 0 waits for it (in the quorum, the
commit vote, the group's own all-reduce) and its Manager keeps beating, so the
Lighthouse keeps the group in every quorum and the other groups wait for it, up to
``distributed.replica_timeout_s`` and the quorum's timeout beyond. Here every rank of a
group of several adds to a counter of its own in the group's store (rank 0's, at
``MASTER_ADDR:MASTER_PORT``) every :data:`BEAT_S`, from a thread of its own, and reads
the others' (rank 0 reads every other rank's; the others need only its store to
answer). While the group is in a step (:meth:`GroupPulse.arm`, from its quorum to
its commit), a rank whose counter has not moved for the Lighthouse's heartbeat timeout
plus 0.25 s, or a store that has refused as long, is lost: this process says
so in one line and ends at once (exit 1). Its torchrun then restarts the group's
workers (a group of several nodes: on all of them), rank 0's Manager stops beating,
and the Lighthouse leaves the group out of the next quorum; the others train on.

A thread beats whatever the rank's main thread does (a long checkpoint write, a slow
batch), so a silent counter means a stopped process, a lost link or a dead one. Not
judged: a rank outside a step (one that finished the run, or stopped, ends before its
peers, rank 0's store with it, and a peer then writing a checkpoint must not take that
for a loss); a rank not yet beating (each beats once before its group's first quorum);
a rank that said it left the run (its pulse closed); and anything while this process
itself was stopped or starved (a node frozen with its
whole group and continued: every counter is old, its own too, and the group trains on
in the same processes). A store that does not answer within the silence (rank 0's node
frozen or cut off) is not judged either: rank 0's Manager is silent then too, so the
Lighthouse already leaves the group out; a store that refuses (rank 0 gone) is.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta

from train.core.errors import EXIT_TRAINING_FAILED
from train.core.run import protocol
from train.core.run.protocol import Reporter

log = logging.getLogger("train")

BEAT_S = 0.25
END_WAIT_S = 10.0  # rank 0, at the end: at most this long for the others to stop beating
PREFIX = "trainpod/pulse/"
ENDED = -2  # a peer's count once it said it left the run


class GroupPulse:
    """This rank's beat in its group's store, and its watch over the group's others."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, group: int,
                 silent_s: float, name: str | None = None):
        self.rank, self.world_size, self.group = rank, world_size, group
        self.silent_s = silent_s
        self._name = name or socket.gethostname()
        self._address = (host, port)
        self._armed = threading.Event()
        self._closed = threading.Event()
        now = time.monotonic()
        # rank 0 (its Manager beats for the group) watches the others; they watch its
        # store: a rank 0 gone refuses them, a frozen one is the Lighthouse's to see
        self._seen = dict.fromkeys(range(1, world_size), (-1, now)) if rank == 0 else {}
        self._answered = now
        # the first beat before the group's first quorum: a rank in a quorum has beaten,
        # so a peer's silence from then on is judged, however soon it froze
        store = self._beat_or_none(None)
        self._thread = threading.Thread(target=self._run, args=(store,), name="group-pulse",
                                        daemon=True)
        self._thread.start()

    def arm(self) -> None:
        """The group is in a step: a silent rank from now on is lost."""
        now = time.monotonic()
        # a rank is judged by its silence while armed (the first beat of a restarted
        # peer may have come before the arming)
        self._seen = {r: (count, max(at, now - BEAT_S)) for r, (count, at) in
                      self._seen.items()}
        self._answered = max(self._answered, now - BEAT_S)
        self._armed.set()

    def disarm(self) -> None:
        self._armed.clear()

    def close(self) -> None:
        """Stop beating. Rank 0's process holds the store: it first waits, bounded,
        until the others stopped theirs, so that no beat meets a store gone (torch
        prints pages of C++ frames for that)."""
        self._armed.clear()
        self._closed.set()
        self._thread.join(timeout=END_WAIT_S + 2 * self.silent_s)

    def _run(self, store) -> None:
        last = time.monotonic()
        while not self._closed.wait(BEAT_S):
            began = time.monotonic()
            store = self._beat_or_none(store)
            if time.monotonic() - last > self.silent_s / 2 + BEAT_S:
                self._rebase()  # this process itself was stopped (or starved) meanwhile
            else:
                self._judge(store)
            last = began
        if store is not None and self.rank != 0:
            try:
                store.add(f"{PREFIX}end/{self.rank}", 1)
            except (RuntimeError, OSError):  # rank 0 gone first: nothing waits for it
                pass
        elif store is not None:
            self._wait_for_the_others(store)

    def _rebase(self) -> None:
        """Judge the others' silence from now on: a process thawed after a freeze of its
        whole group (a node stopped, then continued) finds every counter old, its own
        too, and none of them lost."""
        now = time.monotonic()
        self._seen = {r: (count, now) for r, (count, _) in self._seen.items()}
        self._answered = now

    def _beat_or_none(self, store):
        """Beat (connecting first when not connected): the store, or None when it did
        not answer."""
        from torch.distributed import TCPStore
        try:
            if store is None:
                store = TCPStore(*self._address, is_master=False,
                                 timeout=timedelta(seconds=self.silent_s),
                                 wait_for_workers=False)
                store.set(f"{PREFIX}host/{self.rank}", self._name)
            self._beat(store)
            return store
        except (RuntimeError, OSError, ValueError):  # torch's store errors: its silence
            return None

    def _wait_for_the_others(self, store) -> None:
        deadline = time.monotonic() + END_WAIT_S
        others = list(self._seen)
        while others and time.monotonic() < deadline:
            try:
                self._beat(store)
                others = [r for r in others if self._seen[r][0] != ENDED and
                          time.monotonic() - self._seen[r][1] <= self.silent_s]
            except (RuntimeError, OSError):
                return
            time.sleep(BEAT_S)

    def _beat(self, store) -> None:
        store.add(f"{PREFIX}{self.rank}", 1)
        now = time.monotonic()
        for r, (count, at) in self._seen.items():
            current = store.add(f"{PREFIX}{r}", 0)  # 0 adds nothing, and never blocks
            if store.add(f"{PREFIX}end/{r}", 0):  # it left the run: its silence is no loss
                current = ENDED
            self._seen[r] = (current, now) if current != count else (count, at)
        self._answered = now

    def _judge(self, store) -> None:
        if not self._armed.is_set():
            return
        now = time.monotonic()
        if now - self._answered > self.silent_s:
            self._leave(f"its store (rank 0's, {self._address[0]}:{self._address[1]}) has "
                        f"not answered for {now - self._answered:.1f} s", store)
        for r, (count, at) in self._seen.items():
            if count > 0 and now - at > self.silent_s:  # (not yet beating, or ended)
                self._leave(f"rank {r}{self._host_of(store, r)} has been silent for "
                            f"{now - at:.1f} s (frozen, cut off or gone)", store)

    def _host_of(self, store, rank: int) -> str:
        try:
            return f" ({store.get(f'{PREFIX}host/{rank}').decode()})" if store else ""
        except (RuntimeError, OSError, UnicodeDecodeError):  # the name is a courtesy
            return ""

    def _leave(self, why: str, store) -> None:
        if not self._armed.is_set():  # the step ended meanwhile
            return
        line = (f"replica group {self.group}: {why}; this rank leaves so that its group "
                "restarts and the other groups train on without it")
        log.error("%s", line)
        # the launcher names it; not kept as a failure (a freeze does not repeat because
        # of the checkpoint a restart resumes from, and must not stop the next restart)
        reporter = Reporter.from_environ()
        protocol.write(reporter.folder, reporter.report(exit_code=EXIT_TRAINING_FAILED,
                                                        error=why))
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(EXIT_TRAINING_FAILED)
