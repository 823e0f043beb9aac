"""A tracker's calls on a thread of its own, behind a bounded buffer, so that a tracker
server that is slow, restarting or gone never holds a training step, nor the end of a run
beyond its bound.

The training loop only hands rows over (:meth:`Sender.metrics`, :meth:`Sender.call`);
one daemon thread per tracker makes the calls, in order. When a call fails the way an
outage does (no connection, a timeout, a 5xx or 429 answer), the thread says so once
(``MLflow unreachable from step 40 (...)``), keeps the rows (up to BUFFER_VALUES metric
values; beyond that the oldest are dropped and counted) and tries again with a growing
pause; when a call succeeds again it says so once (``MLflow back after 37 s: 120
metrics buffered (sent now), 0 dropped``). A call the server refuses (a 4xx answer: the
run was deleted, a value it will never take) ends that tracker with one warning, as
retrying cannot help. At the end of a run, :meth:`Sender.close` queues the run's close
and :meth:`Sender.wait` waits for the buffer to drain and the close to be done, within
the time the caller still has; past it both are abandoned and it says what was left
(the thread is a daemon, and the worker ends without waiting for threads:
train/core/machine/host.py ``exit_now``).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from train.core.config.tracking import said

log = logging.getLogger("train")

BUFFER_VALUES = 100_000  # metric values kept while a tracker is unreachable
BATCH_VALUES = 1000      # metric values per call (MLflow's limit for one log_batch)
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 15.0  # the pause between tries during an outage
POLL_S = 0.1             # how often a waiting close looks at its deadline

Row = tuple[int, dict[str, float]]
# the root of a client's "API request to URL failed with exception HTTPConnectionPool(...):
# Max retries exceeded ... NewConnectionError(...: [Errno 111] Connection refused')"
OS_ERROR = re.compile(r"\[Errno -?\d+\] [^'\")\]]+")


@dataclass(eq=False)  # found in the buffer by identity: two rows may hold the same values
class Job:
    """One call to make: metric rows (``call`` None) or anything else (an upload, closing)."""
    what: str
    call: Callable[[], None] | None = None
    rows: list[Row] = field(default_factory=list)
    last: bool = False  # the tracker's close: the thread ends after it


class Sender:
    """One tracker's calls, in order, on a daemon thread. ``send_rows(rows)`` sends
    metric rows in one call; ``refused(exc)`` tells a refusal (give up) from an outage
    (keep the rows, try again)."""

    def __init__(self, name: str, send_rows: Callable[[list[Row]], None],
                 refused: Callable[[BaseException], bool], *,
                 capacity: int = BUFFER_VALUES, clock: Callable[[], float] = time.monotonic):
        self.name, self._send_rows, self._refused = name, send_rows, refused
        self._capacity, self._clock = capacity, clock
        self._jobs: deque[Job] = deque()
        self._values = 0                # metric values waiting
        self._cond = threading.Condition()
        self._ended = False             # refused, closed or abandoned: nothing more is sent
        self._down_since: float | None = None
        self._late = self._dropped = 0  # metric values kept / dropped during this outage
        self._step = 0                  # the newest step handed over
        self._behind = False            # said that a slow server made it drop metrics
        self._thread = threading.Thread(target=self._run, name=f"tracker {name}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the loop's side

    def metrics(self, step: int, values: dict[str, float]) -> None:
        with self._cond:
            if self._ended:
                return
            self._step = step
            self._jobs.append(Job("logging", rows=[(step, dict(values))]))
            self._values += len(values)
            if self._down_since is not None:
                self._late += len(values)
            self._trim()
            self._cond.notify()

    def call(self, what: str, call: Callable[[], None]) -> None:
        """Any other call (an upload), in order with the metrics."""
        self._add(Job(what, call))

    def close(self, call: Callable[[], None]) -> None:
        """``call`` (the run's close) comes last, after what waits; then the thread ends."""
        self._add(Job("closing", call, last=True))

    def wait(self, seconds_left: Callable[[], float]) -> str | None:
        """Wait for the close while ``seconds_left()`` is above 0. None when all was
        sent (or the tracker had been left out); else what was abandoned, in words."""
        while self._thread.is_alive() and seconds_left() > 0:
            self._thread.join(min(POLL_S, max(seconds_left(), 0.0)))
        with self._cond:
            if not self._thread.is_alive():
                return None
            self._ended = True  # the thread stops after the call it is in, if it returns
            self._cond.notify()
            return self._abandoned()

    @property
    def running(self) -> bool:
        """False once the tracker refused a call (it is then left out) or was closed."""
        return not self._ended

    # ------------------------------------------------------------ the thread's side

    def _add(self, job: Job) -> None:
        with self._cond:
            if not self._ended:
                self._jobs.append(job)
                self._cond.notify()

    def _trim(self) -> None:
        """Over capacity: drop the oldest metric rows (never an upload or the close)."""
        while self._values > self._capacity:
            oldest = next((j for j in self._jobs if j.call is None), None)
            if oldest is None:
                return
            self._jobs.remove(oldest)
            lost = sum(len(values) for _, values in oldest.rows)
            self._values -= lost
            self._dropped += lost
            if self._down_since is None and not self._behind:  # a slow server, not gone
                self._behind = True
                log.warning("%s falls behind: more than %d metrics wait, the oldest are "
                            "dropped (metrics.jsonl has every row)", self.name, self._capacity)

    def _abandoned(self) -> str:
        waiting = self._values
        closing = any(j.last for j in self._jobs)
        parts = [f"{waiting} metrics unsent"] if waiting else []
        parts += ["its run left RUNNING on the server"] if closing else []
        why = (f"unreachable for {self._clock() - self._down_since:.0f} s"
               if self._down_since is not None else "a call did not return")
        return f"{self.name} ({', '.join(parts) or 'its last call'}; {why})"

    def _next(self) -> list[Job] | None:
        """The jobs to send in one call (several metric rows together), or None: end."""
        with self._cond:
            while not self._jobs and not self._ended:
                self._cond.wait()
            if self._ended:
                return None
            if self._jobs[0].call is not None:
                return [self._jobs[0]]
            batch, values = [], 0
            for job in self._jobs:
                if job.call is not None or (batch and values + len(job.rows[0][1])
                                            > BATCH_VALUES):
                    break
                batch.append(job)
                values += len(job.rows[0][1])
            return batch

    def _run(self) -> None:
        pause = RETRY_FIRST_S
        while (batch := self._next()) is not None:
            try:
                if batch[0].call is not None:
                    batch[0].call()
                else:
                    self._send_rows([row for job in batch for row in job.rows])
            except Exception as exc:  # the tracker's own errors, whatever their class
                if self._refused(exc):
                    self._give_up(batch[0].what, exc)
                    return
                self._outage(batch, exc)
                with self._cond:
                    self._cond.wait_for(lambda: self._ended, timeout=pause)
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            pause = RETRY_FIRST_S
            if self._sent(batch):
                return

    def _sent(self, batch: list[Job]) -> bool:
        """Take a sent batch off the buffer; True when it was the close."""
        with self._cond:
            if self._ended:  # abandoned while the call ran: nothing more to say
                return True
            for job in batch:
                if job in self._jobs:  # (not dropped meanwhile)
                    self._jobs.remove(job)
                    self._values -= sum(len(values) for _, values in job.rows)
            if self._down_since is not None:
                log.warning("%s back after %.0f s: %d metrics buffered (sent now), %d dropped",
                            self.name, self._clock() - self._down_since,
                            self._late - self._dropped, self._dropped)
                self._down_since = None
            if batch[-1].last:
                self._ended = True
            return self._ended

    def _outage(self, batch: list[Job], exc: BaseException) -> None:
        with self._cond:
            if self._down_since is not None or self._ended:
                return
            self._down_since = self._clock()
            self._late, self._dropped = self._values, 0
            step = batch[0].rows[0][0] if batch[0].rows else self._step
        log.warning("%s unreachable from step %d (%s); training goes on, its metrics wait "
                    "here and are sent when it answers (metrics.jsonl has every row)",
                    self.name, step, cause(exc))

    def _give_up(self, what: str, exc: BaseException) -> None:
        with self._cond:
            self._ended = True
            self._jobs.clear()
            self._values = 0
        log.warning("%s: %s failed (%s); training goes on without it (metrics.jsonl has "
                    "every row)", self.name, what, said(exc, 200))


def cause(exc: BaseException) -> str:
    """Why a call failed, short: the operating system's words when the message holds
    them (``[Errno 111] Connection refused``), else the message itself."""
    found = OS_ERROR.search(str(exc))
    return found.group(0).strip() if found else said(exc, 200)
