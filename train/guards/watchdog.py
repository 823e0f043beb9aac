"""A step, an evaluation or a checkpoint that makes no progress becomes a named hang
instead of a silent one.

Each rank's report (:mod:`train.core.run.protocol`) says which step it reached, refreshed at
most every PROGRESS_EVERY_S, so that the launcher can name a rank that stopped arriving
(frozen, SIGSTOPped) when the others time out waiting for it. When a step makes no
progress for STEPS_OF_SILENCE times its usual time (at least FLOOR_S, at most
BEFORE_COLLECTIVES of ``distributed.timeout_s``, so that it reports before the other
ranks' collectives time out; steps before the first logged step time get that much),
a watching thread writes the rank's report (where its main
thread is: the innermost frame of the run's own code, outside Python's library and
torch, and whether the thread waits for the other ranks, for the DataLoader's workers,
or is in code of its own), prints every thread's stack to the rank's log and exits 1.
faulthandler backs the thread up BACKSTOP_S later (up to a twentieth of the limit more:
it is re-armed that seldom), should it not get to run (a C call holding the GIL): then
only the stack dump is there.

Evaluation and checkpoints are watched too (their collectives are where a partition or a
frozen peer would otherwise wait out ``distributed.timeout_s`` unnamed): each is a phase
whose parts say they progressed (an evaluation batch, a checkpoint's agreement round,
a file written), and so is the multi-node preflight check before training (each of its
repetitions, for FLOOR_S). A checkpoint may write for long without a round: its limit
also allows the run's state written at SLOW_DISK_BYTES_S and CHECKPOINTS_OF_SILENCE times
the longest checkpoint seen so far, within the same cap. The line names the phase: ``in
step 31``, ``in the evaluation after step 30``, ``in the checkpoint of step 30``, ``in the
preflight check before training``.

A background checkpoint (``checkpoint.async_save``) is watched on its own: its writer
thread (:mod:`train.checkpoint.store`) and, for sharded checkpoints, DCP's thread, which
agrees with the other ranks over a gloo group of its own, may block on a frozen peer or
a partition while the training thread still steps (or has finished and waits for it).
:meth:`Watchdog.watching_writer` gives the writer a :class:`WriterWatch`; a writer
silent past the checkpoint's allowance ends the rank like any hang, ``in the background
checkpoint of step 30``, naming where the writer (or DCP's thread under it) waits.
"""

from __future__ import annotations

import faulthandler
import math
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from train.core.run.protocol import (
    STUCK_IN_OWN_CODE,
    WAITS_FOR_LOADER,
    WAITS_FOR_RANKS,
    Reporter,
    Waiting,
)

STEPS_OF_SILENCE = 20
FLOOR_S = 120
# A rank stuck outside a collective must report before the others' collectives time out
# (distributed.timeout_s: they would fail first, and torchrun stop it unheard), and a
# rank waiting in one must be seen waiting, not half-way through raising the timeout.
BEFORE_COLLECTIVES = 0.8
# A checkpoint's limit allows its state written this slowly (a busy network filesystem),
# and this many times the longest checkpoint of the run so far.
SLOW_DISK_BYTES_S = 50e6
CHECKPOINTS_OF_SILENCE = 3
PROGRESS_EVERY_S = 1.0  # a small file replaced by rename: nothing measurable per step
WAIT_SEEN_S = 2.0  # silent this long and found in a collective: reported as waiting
BACKSTOP_S = 5
REARM_SHARE = 0.05  # faulthandler's backstop is re-armed this far into the limit
# Frames that mean "waiting for the other ranks": collectives, and backward, where DDP's
# gradient all-reduce waits for every rank.
_WAITING = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/")
_LOADER = "/torch/utils/data/"
_DCP = "/torch/distributed/checkpoint/"  # DCP's own thread, under a background save
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

STEP, EVALUATION, CHECKPOINT, PREFLIGHT = "step", "evaluation", "checkpoint", "preflight"


def _phase_words(phase: str, step: int) -> str:
    if phase == PREFLIGHT:
        return "in the preflight check before training"
    if phase == EVALUATION:
        return f"in the evaluation after step {step}"
    if phase == CHECKPOINT:
        return f"in the checkpoint of step {step}"
    return f"in step {step + 1}"


class WriterWatch:
    """A background checkpoint writer's side of the watchdog: progress() after each part
    (a file written, a marker seen); waits_for(what) while it waits on other ranks in a
    way no frame shows (polling for their files)."""

    def __init__(self, step: int, limit: float):
        self.step, self.limit = step, limit
        self.ident = threading.get_ident()
        self.last = time.monotonic()
        self.waiting: str | None = None

    def progress(self) -> None:
        self.last, self.waiting = time.monotonic(), None

    def waits_for(self, what: str) -> None:
        self.waiting = what


class Watchdog:
    """pet(step) once per step; ``with watching(phase, step):`` around evaluation and
    checkpoints, whose parts call progress(); pause() where nothing is to be watched."""

    def __init__(self, timeout_s: int, reporter: Reporter | None = None,
                 state_bytes: int = 0):
        self.timeout_s, self.reporter = timeout_s, reporter
        self.cap = BEFORE_COLLECTIVES * timeout_s
        self.limit: float = self.cap  # seconds without progress that make a hang (steps)
        self.watched: float = self.cap  # the limit of the phase being watched
        self.state_bytes = state_bytes  # what a checkpoint writes, roughly
        self.longest_checkpoint_s = 0.0
        self.armed_at = self.reported_at = -math.inf
        self.last: float | None = None   # the last sign of progress, None while paused
        self.step, self.phase = 0, STEP
        self.writer: WriterWatch | None = None  # a background checkpoint in flight
        self.step_s: float | None = None  # the agreed step time, once known
        self.wait: Waiting | None = None  # the wait in a collective reported, if any
        self.wait_of: float | None = None  # the silence (its `last`) that wait belongs to
        self._thread: threading.Thread | None = None

    def pet(self, step: int = 0) -> None:
        """A step begins. (What :meth:`progress` does, inline: this runs every step.)"""
        self.step, self.phase, self.watched = step, STEP, self.limit
        now = self.last = time.monotonic()
        if now - self.armed_at >= max(1.0, self.watched * REARM_SHARE):  # rearm_s()
            self._arm(now)
        if self._thread is None:
            self._start()
        if self.reporter is not None and now - self.reported_at >= PROGRESS_EVERY_S:
            self.reporter.progress(step)
            self.reported_at = now

    def progress(self) -> None:
        """The watched phase moved on (a step began, a batch was evaluated, a round of a
        checkpoint agreed, a file was written). A no-op while paused."""
        if self.phase is None:
            return
        now = self.last = time.monotonic()
        if now - self.armed_at >= self.rearm_s():
            self._arm(now)
        self._start()

    def rearm_s(self) -> float:
        """Arming faulthandler starts a thread: at most every REARM_SHARE of the limit (a
        second at least), each time that much later, so it never fires earlier than
        BACKSTOP_S after the limit (every 6 s for the floor's 120 s)."""
        return max(1.0, self.watched * REARM_SHARE)

    def _arm(self, now: float) -> None:
        faulthandler.dump_traceback_later(self.watched + BACKSTOP_S + self.rearm_s(), exit=True)
        self.armed_at = now

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog",
                                            daemon=True)
            self._thread.start()

    def pace(self, step_time_s: float) -> None:
        """The step time every rank agrees on (an all-reduced mean): a step silent for
        STEPS_OF_SILENCE of them is a hang, however long distributed.timeout_s is."""
        self.limit = min(self.cap, max(FLOOR_S, STEPS_OF_SILENCE * step_time_s))
        self.step_s = step_time_s

    def checkpoint_limit(self) -> float:
        """A checkpoint's parts may take longer than a step: its state written slowly,
        or a few times the longest checkpoint so far, within the cap."""
        return min(self.cap, max(self.limit, self.state_bytes / SLOW_DISK_BYTES_S,
                                 CHECKPOINTS_OF_SILENCE * self.longest_checkpoint_s))

    @contextmanager
    def watching(self, phase: str, step: int) -> Iterator[None]:
        """Watch evaluation or a checkpoint of ``step``; afterwards the rest of the step
        (the stop agreement) is watched again, until pause() or the next pet()."""
        in_step = self.step
        self.step, self.phase = step, phase
        self.watched = self.checkpoint_limit() if phase == CHECKPOINT else \
            min(self.cap, FLOOR_S) if phase == PREFLIGHT else self.limit
        self.armed_at = -math.inf  # re-armed at once, for this phase's limit
        started = time.monotonic()
        self.progress()
        try:
            yield
        finally:
            if phase == CHECKPOINT:
                self.longest_checkpoint_s = max(self.longest_checkpoint_s,
                                                time.monotonic() - started)
            self.step, self.phase, self.watched = in_step, STEP, self.limit
            self.armed_at = -math.inf
            self.progress()

    @contextmanager
    def watching_writer(self, step: int) -> Iterator[WriterWatch]:
        """In a background checkpoint's writer thread, around its work: watched with
        the checkpoint's allowance whatever the training thread does meanwhile."""
        watch = WriterWatch(step, self.checkpoint_limit())
        self.writer = watch
        self._start()
        try:
            yield watch
        finally:
            if self.writer is watch:
                self.writer = None

    def pause(self) -> None:
        """Disarm until the next pet() (which re-arms at once)."""
        faulthandler.cancel_dump_traceback_later()
        self.armed_at, self.last, self.phase = -math.inf, None, None

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            last = self.last
            if last is not None and time.monotonic() - last > self.watched:
                self._hung(time.monotonic() - last)
            if self.reporter is not None:
                self._watch_wait(last)
            writer = self.writer
            if writer is not None and time.monotonic() - writer.last > writer.limit:
                self._writer_hung(writer, time.monotonic() - writer.last)

    def _watch_wait(self, last: float | None) -> None:
        """Report a wait in a collective (its phase, since when) while it lasts, so that the
        launcher can tell when every node waits for the others (a partition); end it as
        hung with the launcher's line once it judged so (launcher.liveness.partition)."""
        waiting = last is not None and time.monotonic() - last > WAIT_SEEN_S and \
            where(sys._current_frames().get(threading.main_thread().ident))[0] == \
            WAITS_FOR_RANKS
        if waiting and (self.wait is None or self.wait_of != last):
            self.wait = Waiting(_phase_words(self.phase, self.step), time.time(), self.step_s)
            self.wait_of = last
            self.reporter.waiting(self.step, self.wait)
        elif not waiting and self.wait is not None:
            self.wait = None
            self.reporter.waiting(self.step, None)
        if self.wait is not None and (line := self.reporter.verdict(self.wait.phase)):
            self._end(self.step, WAITS_FOR_RANKS, line)

    def _hung(self, silent_s: float) -> None:
        frame = sys._current_frames().get(threading.main_thread().ident)
        kind, at = where(frame)
        if self.watched == self.cap:
            limit = f"{BEFORE_COLLECTIVES:.0%} of distributed.timeout_s"
        elif self.phase == CHECKPOINT and self.watched > self.limit:
            limit = "the checkpoint's allowance"
        elif self.phase == PREFLIGHT:
            limit = "the preflight's allowance per part"
        else:
            limit = f"{STEPS_OF_SILENCE} x its usual step time, at least {FLOOR_S} s"
        error = (f"no progress for {silent_s:.0f} s {_phase_words(self.phase, self.step)} "
                 f"({limit}: {self.watched:.0f} s): {WAITS[kind]} at {at}")
        self._end(self.step, kind, error)

    def _writer_hung(self, writer: WriterWatch, silent_s: float) -> None:
        kind, at = _writer_where(writer)
        waits = f"waiting for {writer.waiting}" if writer.waiting else WAITS[kind]
        limit = f"{BEFORE_COLLECTIVES:.0%} of distributed.timeout_s" \
            if writer.limit == self.cap else "the checkpoint's allowance"
        self._end(writer.step, WAITS_FOR_RANKS if writer.waiting else kind,
                  f"no progress for {silent_s:.0f} s in the background checkpoint of step "
                  f"{writer.step} ({limit}: {writer.limit:.0f} s): {waits} at {at}")

    def _end(self, step: int, kind: str, error: str) -> None:
        if self.reporter is not None:
            self.reporter.hung(step, kind, error)
        rank = self.reporter.ident.rank if self.reporter is not None else 0
        print(f"rank {rank}: hang watchdog: {error}; every thread's stack follows",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)


def _writer_where(writer: WriterWatch) -> tuple[str, str]:
    """Where a background writer waits: in DCP's thread when one is writing (the writer
    only waits for its result), else in the writer's own frames."""
    frames = sys._current_frames()
    main = threading.main_thread().ident
    for ident, frame in frames.items():
        inner_dcp = _innermost_dcp(frame)
        if ident not in (writer.ident, main) and inner_dcp is not None:
            kind, at = where(frame)
            return kind, at if at != "?" else inner_dcp
    return where(frames.get(writer.ident))


def _innermost_dcp(frame) -> str | None:
    """"file:line in function" of the innermost frame of DCP's code, or None."""
    while frame is not None:
        if _DCP in frame.f_code.co_filename:
            code = frame.f_code
            return f"{Path(code.co_filename).name}:{frame.f_lineno} in {code.co_name} (DCP)"
        frame = frame.f_back
    return None
