"""A range of an object that lags far behind the others is asked for again (a hedge),
and the first whole answer wins: the rule and the range's state, for :mod:`.objectget`.

Why: an object arrives as ranged GETs on several connections, and its fetch ends with
its slowest range. On a loaded node over a real link one range in eight sometimes
arrives up to a second after the others (a connection in its own loss recovery, a
reading thread not scheduled), so a fetch that takes half a second at the link's rate
takes one and a half (docs/object-storage.md, "A range that lags").

The rule (:func:`due`): once half of an object's ranges have arrived, a range still
arriving :data:`HEDGE_AFTER` times their median after its request was sent, and at
least :data:`HEDGE_FLOOR_S`, is asked for again, once. The ranges of one object are of
one size and share the link at the same moment, so they normally end close together:
one at twice their median is held up, not slow by its size, and a second connection
(a fresh window, another thread) usually brings it before the first recovers. A hedge
costs at most one range's bytes, and :data:`HEDGES` at once per process bound what they
take from the link. The floor keeps the round trip and a loaded machine's scheduling
jitter from counting as a lag where ranges take milliseconds (small parts, a near
store). The median, not the mean or the slowest: one lagging range does not move it.

The state (:class:`Range`): the first request writes into the file as its answer
arrives; a hedge holds its answer (at most one part, 8 MiB) and writes it only if it is
the first whole one. Every write to the file happens under the range's lock and only
while the range has no winner and the fetch is not over, so a request that lost (or
outlived the fetch) never writes again; it ends at its next read and closes its answer.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import threading
from collections.abc import Callable

HEDGE_AFTER = 2.0    # a range is late at this multiple of the finished ranges' median
HEDGE_FLOOR_S = 0.2  # and never before this many seconds
HEDGES = 2           # hedges under way at once in one process


class Stopped(Exception):
    """Another range of the object failed, or another request for this range won: this
    one is not needed any more."""


class Range:
    """One range ``[start, end)`` of an object and the requests for it (see the module).

    ``done`` resolves once: with the bytes of the first request that brought the whole
    range (its bytes are the ones in the file), or with the failure of the last one when
    none did."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.lock = threading.Lock()
        self.done: concurrent.futures.Future = concurrent.futures.Future()
        self.began: float | None = None   # when its first request was sent
        self.took: float | None = None    # seconds the winning request took
        self.outstanding = 0              # requests made and not ended
        self.hedged = False
        self.won: object | None = None    # the request whose bytes are in the file
        self.closed = False               # the fetch is over: nothing may write

    def writable(self, me: object) -> bool:
        """Whether request ``me`` may still write (asked under ``lock``)."""
        return not self.closed and self.won in (None, me)

    def close(self) -> None:
        """The fetch is over: a chunk being written lands, none is written after."""
        with self.lock:
            self.closed = True

    def end_of(self, me: object, got: int, failure: BaseException | None, took: float,
               land: Callable[[], None] | None = None) -> None:
        """Request ``me`` ended with the whole range (``got`` bytes) or ``failure``;
        ``land`` writes its bytes when they are the first whole answer (a hedge's, held
        until then)."""
        with self.lock:
            self.outstanding -= 1
            if self.done.done():
                return
            if failure is None and self.writable(me):
                if land is not None:
                    land()
                self.won, self.took = me, took
                self.done.set_result(got)
            elif self.outstanding == 0:  # no other request can bring it
                self.done.set_exception(failure or Stopped())


def due(ranges: list[Range], now: float) -> tuple[list[Range], float | None]:
    """The ranges to ask for again at ``now`` (monotonic seconds), and the seconds until
    another may be due (None: not before a range ends)."""
    took = [r.took for r in ranges if r.took is not None]
    if 2 * len(took) < len(ranges):
        return [], None
    limit = max(HEDGE_FLOOR_S, HEDGE_AFTER * statistics.median(took))
    late, wake = [], None
    for r in ranges:
        if r.done.done() or r.hedged:
            continue
        # a range not sent yet (the threads are busy with another object's): look again
        left = HEDGE_FLOOR_S if r.began is None else r.began + limit - now
        if left <= 0:
            late.append(r)
        else:
            wake = left if wake is None else min(wake, left)
    return late, wake


def median_took(ranges: list[Range]) -> float:
    """The median seconds of the ranges that arrived (for the log line of a hedge)."""
    return statistics.median(r.took for r in ranges if r.took is not None)
