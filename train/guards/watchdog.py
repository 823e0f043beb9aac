"""A step that makes no progress becomes a named hang instead of a silent one.

Each rank's report (:mod:`train.core.protocol`) says which step it reached, refreshed at
most every PROGRESS_EVERY_S, so that the launcher can name a rank that stopped arriving
(frozen, SIGSTOPped) when the others time out waiting for it. When a step makes no
progress for STEPS_OF_SILENCE times its usual time (at least FLOOR_S, at most
BEFORE_COLLECTIVES of ``distributed.timeout_s``, so that it reports before the other
ranks' collectives time out; steps before the first logged step time get that much),
a watching thread writes the rank's report (where its main
thread is: the innermost frame of the run's own code, outside Python's library and
torch, and whether the thread waits for the other ranks, for the DataLoader's workers,
or is in code of its own), prints every thread's stack to the rank's log and exits 1.
faulthandler backs the thread up BACKSTOP_S later, should it not get to run (a C call
holding the GIL): then only the stack dump is there.
"""

from __future__ import annotations

import faulthandler
import math
import os
import sys
import sysconfig
import threading
import time
from pathlib import Path

from train.core.protocol import (
    STUCK_IN_OWN_CODE,
    WAITS_FOR_LOADER,
    WAITS_FOR_RANKS,
    Reporter,
)

STEPS_OF_SILENCE = 20
FLOOR_S = 120
# A rank stuck outside a collective must report before the others' collectives time out
# (distributed.timeout_s: they would fail first, and torchrun stop it unheard), and a
# rank waiting in one must be seen waiting, not half-way through raising the timeout.
BEFORE_COLLECTIVES = 0.8
PROGRESS_EVERY_S = 1.0  # a small file replaced by rename: nothing measurable per step
BACKSTOP_S = 5
# Frames that mean "waiting for the other ranks": collectives, and backward, where DDP's
# gradient all-reduce waits for every rank.
_WAITING = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/")
_LOADER = "/torch/utils/data/"
_STDLIB = sysconfig.get_paths()["stdlib"]


def _stdlib(name: str) -> bool:
    return name.startswith(_STDLIB) and "-packages" not in name[len(_STDLIB):]


def where(frame) -> tuple[str, str]:
    """(what the thread waits for: WAITS_FOR_RANKS, WAITS_FOR_LOADER or STUCK_IN_OWN_CODE,
    decided by its innermost
    frame outside Python's library; "file:line in function" of its innermost frame that
    is neither Python's nor torch's: where a reader looks first)."""
    inner, shown = None, None
    while frame is not None:
        name = frame.f_code.co_filename
        if inner is None and not _stdlib(name):
            inner = name
        if shown is None and not _stdlib(name) and "/torch/" not in name:
            shown = f"{Path(name).name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    if inner is not None and any(part in inner for part in _WAITING):
        kind = WAITS_FOR_RANKS
    elif inner is not None and _LOADER in inner:
        kind = WAITS_FOR_LOADER
    else:
        kind = STUCK_IN_OWN_CODE
    return kind, shown or "?"


WAITS = {WAITS_FOR_RANKS: "waiting for the other ranks (a collective)",
         WAITS_FOR_LOADER: "waiting for its DataLoader workers (data.num_workers)",
         STUCK_IN_OWN_CODE: "stuck in its own code"}


class Watchdog:
    """pet(step) once per step; pause() around evaluation and checkpoints."""

    def __init__(self, timeout_s: int, reporter: Reporter | None = None):
        self.timeout_s, self.reporter = timeout_s, reporter
        self.cap = BEFORE_COLLECTIVES * timeout_s
        self.limit: float = self.cap  # seconds without progress that make a hang
        self.armed_at = self.reported_at = -math.inf
        self.last: float | None = None   # the last pet, None while paused
        self.step = 0
        self._thread: threading.Thread | None = None

    def pet(self, step: int = 0) -> None:
        now = time.monotonic()
        self.last, self.step = now, step
        if now - self.armed_at >= 1.0:  # arming faulthandler starts a thread: once a second
            faulthandler.dump_traceback_later(self.limit + BACKSTOP_S, exit=True)
            self.armed_at = now
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog",
                                            daemon=True)
            self._thread.start()
        if self.reporter is not None and now - self.reported_at >= PROGRESS_EVERY_S:
            self.reporter.progress(step)
            self.reported_at = now

    def pace(self, step_time_s: float) -> None:
        """The step time every rank agrees on (an all-reduced mean): a step silent for
        STEPS_OF_SILENCE of them is a hang, however long distributed.timeout_s is."""
        self.limit = min(self.cap, max(FLOOR_S, STEPS_OF_SILENCE * step_time_s))

    def pause(self) -> None:
        """Disarm until the next pet() (which re-arms at once)."""
        faulthandler.cancel_dump_traceback_later()
        self.armed_at, self.last = -math.inf, None

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            last = self.last
            if last is not None and time.monotonic() - last > self.limit:
                self._hung(time.monotonic() - last)

    def _hung(self, silent_s: float) -> None:
        frame = sys._current_frames().get(threading.main_thread().ident)
        kind, at = where(frame)
        limit = (f"{BEFORE_COLLECTIVES:.0%} of distributed.timeout_s" if self.limit == self.cap
                 else f"{STEPS_OF_SILENCE} x its usual step time, at least {FLOOR_S} s")
        error = (f"no progress for {silent_s:.0f} s in step {self.step + 1} ({limit}: "
                 f"{self.limit:.0f} s): {WAITS[kind]} at {at}")
        if self.reporter is not None:
            self.reporter.hung(self.step, kind, error)
        rank = self.reporter.ident.rank if self.reporter is not None else 0
        print(f"rank {rank}: hang watchdog: {error}; every thread's stack follows",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)
