"""The end of a run, bounded: nothing outside the training loop can hold a worker's exit.

Once the loop is over (its last checkpoint written), what is left waits on things the
run does not control: a tracker flushing its buffer and closing its run (a server that
is gone), an upload, the DataLoader's worker processes (a dataset whose worker never
finishes exiting), helper threads. All of it shares one deadline,
``train.shutdown_timeout_s`` from the first such wait; past it the run ends anyway and
one line names what was abandoned. A stop signal (SIGTERM, SIGINT) during that time, or
one that stopped the run, leaves at most SIGNALLED_S: a platform that wants the process
gone (Kubernetes, SLURM, a user's Ctrl-C) gets it within its grace period.

Helper threads are daemons and the worker ends with ``os._exit`` (train/core/machine/host.py
``exit_now``), so no thread can keep the process alive after this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("train")

SIGNALLED_S = 2.0  # what is left of the shutdown after a stop signal


class Shutdown:
    """One deadline for every wait of a run's end, and the list of what was abandoned."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s, self._clock = timeout_s, clock
        self._deadline: float | None = None
        self._signalled = False
        self.abandoned: list[str] = []

    @property
    def begun(self) -> bool:
        return self._deadline is not None

    def begin(self) -> None:
        """The first wait of the shutdown starts the clock (later calls change nothing)."""
        if self._deadline is None:
            self._deadline = self._clock() + (min(self.timeout_s, SIGNALLED_S)
                                              if self._signalled else self.timeout_s)

    def signalled(self) -> None:
        """A stop signal arrived (from the signal handler): what is left is cut short."""
        self._signalled = True
        if self._deadline is not None:
            self._deadline = min(self._deadline, self._clock() + SIGNALLED_S)

    def seconds_left(self) -> float:
        """Time left for the waits (begins the shutdown if it had not begun)."""
        self.begin()
        return max(0.0, self._deadline - self._clock())

    def abandon(self, what: str | None) -> None:
        """``what`` was given up on (None: nothing was)."""
        if what:
            self.abandoned.append(what)

    def report(self) -> None:
        """The one line of what the end of the run gave up on, if anything."""
        if self.abandoned:
            bound = (f"{SIGNALLED_S:.0f} s after a stop signal" if self._signalled
                     else f"train.shutdown_timeout_s={self.timeout_s:g}")
            log.warning("shutdown: did not wait longer (%s) for: %s; the run's checkpoint "
                        "and metrics.jsonl are complete", bound, "; ".join(self.abandoned))
