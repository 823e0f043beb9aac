"""How a fault of a replica group (``distributed.fault_tolerance: replicas``) is measured,
wherever the groups run (bench/replicas.py: one launcher on 127.0.0.1; bench/replicas_rig.py:
a host per group on the network-namespace rig).

The clock starts when the fault is made (the signal sent, the link cut) and stops at the
first step committed in ``RUN_DIR/ledger.jsonl`` (its lines polled with a timestamp) that
the fault held up: a step group 1 did not compute, or computed with a new worker (a step
whose all-reduce group 1 had joined before the fault commits at once: it is skipped,
and counted). Then when group 1 computes a committed step again, and the other groups'
worker pids before and after (unchanged: no survivor restarted). Medians and the
nearest-rank p95 of each kind.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

VICTIM = 1  # the group each fault hits


def load() -> str:
    """The 1-minute load average now."""
    return Path("/proc/loadavg").read_text().split()[0]


def p95(values: list[float]) -> float:
    """The nearest-rank 95th percentile: the smallest value that at least 95 % of the
    values do not exceed (of fewer than 20 values, the largest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class LedgerWatch:
    """A ledger's lines as they are appended: each committed step's replica groups and
    when this process first saw its line. A torn last line waits for its end."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial, self.inode = path, 0, b"", None
        self.groups: list[tuple[int, ...]] = []
        self.seen: list[float] = []

    def poll(self) -> int:
        """Read what was appended; the number of committed steps seen."""
        try:
            with open(self.path, "rb") as f:
                stat = os.fstat(f.fileno())
                inode = stat.st_ino
                if inode != self.inode or stat.st_size < self.offset:  # new, or rewritten
                    self.inode, self.offset, self.partial, self.groups = inode, 0, b"", []
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return len(self.groups)
        now, self.offset = time.monotonic(), self.offset + len(data)
        *whole, self.partial = (self.partial + data).split(b"\n")
        for line in whole:
            self.groups.append(tuple(json.loads(line)["replicas"]))
        # read again from the start: the lines already seen keep their times
        self.seen = self.seen[:len(self.groups)]
        self.seen += [now] * (len(self.groups) - len(self.seen))
        return len(self.groups)

    def wait(self, done: Callable[[int], bool], timeout: float, what: str) -> int:
        deadline = time.monotonic() + timeout
        while not done(n := self.poll()):
            if time.monotonic() > deadline:
                sys.exit(f"no {what} within {timeout} s ({n} committed steps; ledger "
                         f"{self.path})")
            time.sleep(0.005)
        return n


class Watched:
    """What the bench watches of a running job of replica groups, however it runs: its
    ledger, and each group's worker."""

    groups: int            # replicas + spares
    ledger: LedgerWatch

    def workers(self) -> dict[int, int]:
        """Replica group -> the pid of its worker, now."""
        raise NotImplementedError

    def steady(self, timeout: float = 300) -> None:
        """Every group has its worker, the run is past its start (200 committed steps)
        and the last 50 had group 1 in."""
        deadline = time.monotonic() + timeout
        self.ledger.wait(lambda n: n >= 200 and all(VICTIM in g for g in
                                                   self.ledger.groups[-50:]),
                         timeout, f"50 steps in a row with group {VICTIM}")
        while len(self.workers()) < self.groups and time.monotonic() < deadline:
            time.sleep(0.2)


@dataclass(frozen=True)
class Fault:
    next_step_s: float  # the signal -> the next committed step the fault held up
    in_flight: int      # steps group 1 had computed before the signal, committed meanwhile
    back_s: float       # the signal -> a committed step computed by the victim's group
    before: dict[int, int]
    after: dict[int, int]
    load: str

    @property
    def survivors_unchanged(self) -> bool:
        return all(self.after.get(g) == pid for g, pid in self.before.items() if g != VICTIM)


def fault(run: Watched, signum: int, timeout: float = 180) -> Fault:
    """One signal to group 1's worker (SIGSTOP: SIGCONT once measured), measured."""
    victim = run.workers()[VICTIM]
    if signum == signal.SIGSTOP:
        return measure(run, lambda: os.kill(victim, signum),
                       lambda: os.kill(victim, signal.SIGCONT), timeout)
    return measure(run, lambda: os.kill(victim, signum), None, timeout)


def measure(run: Watched, hit: Callable[[], None], undo: Callable[[], None] | None,
            timeout: float = 180) -> Fault:
    """One fault of group 1, measured; returns once the group trains again. ``undo``
    (None: the fault is a kill, its worker replaced) ends a fault that holds the worker
    (a stop, a cut link) once its held-up step committed."""
    before, level = run.workers(), load()
    victim, count = before[VICTIM], run.ledger.poll()
    start = time.monotonic()
    hit()
    try:
        held = held_up(run, count, victim, undo is not None, timeout)
    finally:
        if undo is not None:
            undo()
    back = rejoined(run, victim, undo is not None, timeout)
    more = len(run.ledger.groups) + 20
    run.ledger.wait(lambda n: n >= more, timeout, "20 more steps")
    return Fault(run.ledger.seen[held] - start, held - count, back - start, before,
                 run.workers(), level)


def held_up(run: Watched, count: int, victim: int, stopped: bool, timeout: float) -> int:
    """The index of the first step committed after the fault that it held up: one that
    group 1 did not compute, or (a kill) computed by its new worker. A step whose
    all-reduce group 1 had already joined when the signal came commits anyway, at once:
    it is skipped (a stopped worker, or a killed one not yet replaced, computes none)."""
    i = count
    while True:
        run.ledger.wait(lambda n, i=i: n > i, timeout, "committed step after the fault")
        if VICTIM not in run.ledger.groups[i] or \
                (not stopped and run.workers().get(VICTIM, victim) != victim):
            return i
        i += 1


def rejoined(run: Watched, victim: int, resumed: bool, timeout: float) -> float:
    """When group 1 computed a committed step again: the first such line seen once it
    has a worker again (``resumed``: any, the stopped one went on; else a new one, which
    torchrun started in place of ``victim``)."""
    deadline = time.monotonic() + timeout
    while (pid := run.workers().get(VICTIM)) is None or not (resumed or pid != victim):
        if time.monotonic() > deadline:
            sys.exit(f"group {VICTIM} has no worker {timeout} s after the fault")
        time.sleep(0.1)
    since = run.ledger.poll()
    run.ledger.wait(lambda n: any(VICTIM in g for g in run.ledger.groups[since:n]), timeout,
                    f"step of group {VICTIM} after the fault")
    first = next(i for i in range(since, len(run.ledger.groups))
                 if VICTIM in run.ledger.groups[i])
    return run.ledger.seen[first]


def series(run: Watched, label: str, n: int, one: Callable[[], Fault]) -> list[Fault]:
    """``n`` faults made and measured by ``one``, each once the run is steady, each said."""
    run.steady()
    out = []
    for i in range(n):
        if i:  # group 1 back for 50 steps in a row
            run.steady()
        out.append(f := one())
        skipped = f" ({f.in_flight} step in flight committed first)" if f.in_flight else ""
        print(f"({label}) fault {i + 1}: next step {f.next_step_s:.2f} s{skipped}, group "
              f"{VICTIM} trains again {f.back_s:.2f} s; survivors' pids "
              f"{_pids(f)} (load {f.load})", flush=True)
        time.sleep(2)
    return out


def _pids(f: Fault) -> str:
    pairs = [f"{f.before[g]}->{f.after.get(g)}" for g in sorted(f.before) if g != VICTIM]
    return ", ".join(pairs) + (" unchanged" if f.survivors_unchanged else " CHANGED")


def report(name: str, values: list[float], base: float | None) -> None:
    m = statistics.median(values)
    ratio = f" ({m / base:.2f} x the restart)" if base else ""
    print(f"{name}: median {m:.2f} s, p95 {p95(values):.2f} s over {len(values)}{ratio}")


def summary(name: str, values: list[Fault], base: float | None) -> None:
    """A kind of fault's lines: the next committed step, group 1 back, the survivors."""
    report(name, [f.next_step_s for f in values], base)
    report(f"    group {VICTIM} trains again", [f.back_s for f in values], base)
    same = sum(f.survivors_unchanged for f in values)
    print(f"    survivors' pids unchanged in {same} of {len(values)} faults")
