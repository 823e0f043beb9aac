"""Replica groups (``distributed.fault_tolerance: replicas``) against today's restart,
measured side by side in one run on 127.0.0.1.

1. Recovery: the time from a fault (the moment the signal is sent) to the next step
   committed in ``RUN_DIR/ledger.jsonl`` (its lines polled with a timestamp), median and
   p95 over ``--faults`` faults each (a step whose all-reduce group 1 had joined before
   the signal commits at once: it is skipped, and counted), for
   (a) 2 replica groups + 1 spare, kill -9 of group 1's worker;
   (b) 2 replica groups, no spare, kill -9 of group 1's worker;
   (c) 2 replica groups + 1 spare, SIGSTOP of group 1's worker (SIGCONT once measured);
   (d) today's default (``fault_tolerance: restart``, 2 processes on one node), kill -9
       of one worker -> the next step line (bench/recovery.py's measurement).
   For (a)-(c) also when group 1 trains again, and the survivors' pids before and after
   (unchanged: no survivor restarted).
2. Throughput of 2 groups + 1 spare under a kill -9 of a random non-zero group's worker
   every 30 s for ``--minutes``, as a fraction of the fault-free throughput of the same
   run (committed steps per second, a minute before and a minute after).

Every replica run keeps the default ``distributed.replica_timeout_s`` (60 s): a frozen
group costs the others the Lighthouse's heartbeat timeout, not that
(train/distributed/replica_watch.py), so (c) is about 2.3 s.
The model is the default mlp on synthetic data, a global batch of 16 (10-20 ms a step
on 2 cores). Each run is stopped with SIGTERM (exit 143) and every process is gone
before its files are removed. The defaults are short; numbers worth quoting want
``--faults 10 --minutes 10`` on an idle machine.

    python -m bench.replicas [--faults 5] [--minutes 3] [--sigstop-only]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.recovery import single_node
from tests.harness.multinode import Process
from tests.harness.procs import replica_workers
from tests.harness.runs import ENTRY, clean_env, write_config

FAULT_EVERY_S = 30
REFERENCE_S = 60
VICTIM = 1  # the group whose worker each fault of part 1 hits
MODEL = {"model": {"kind": "mlp"}, "data": {"kind": "synthetic", "num_workers": 0},
         "train": {"max_steps": 10_000_000, "global_batch_size": 16}}
REPLICAS = {**MODEL, "logging": {"every_steps": 1000, "progress": "plain"},
            "checkpoint": {"every_steps": 1000}}
# bench/recovery.py's single-node restart, on the same model: a line per step, a
# checkpoint before the kill at step 30
RESTART = {**MODEL, "logging": {"every_steps": 1, "progress": "plain"},
           "checkpoint": {"every_steps": 20}}


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


class ReplicaRun:
    """``entrypoint.py train`` with replica groups, until stopped."""

    def __init__(self, work: Path, name: str, spares: int):
        self.groups = 2 + spares
        cfg = write_config(work / f"{name}.yaml", {
            **REPLICAS, "run": {"name": name}, "output": {"dir": str(work / "runs")},
            "distributed": {"fault_tolerance": "replicas", "replicas": 2, "spares": spares,
                            "max_restarts": 1000}})
        self.node = Process(name, [sys.executable, ENTRY, "train", str(cfg)], clean_env(),
                            work).start()
        self.ledger = LedgerWatch(work / "runs" / name / "ledger.jsonl")

    def workers(self) -> dict[int, int]:
        return replica_workers(self.node.proc.pid)

    def steady(self, timeout: float = 300) -> None:
        """Every group has its worker, the run is past its start (200 committed steps)
        and the last 50 had group 1 in."""
        deadline = time.monotonic() + timeout
        self.ledger.wait(lambda n: n >= 200 and all(VICTIM in g for g in
                                                   self.ledger.groups[-50:]),
                         timeout, f"50 steps in a row with group {VICTIM}")
        while len(self.workers()) < self.groups and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> int:
        """SIGTERM to the launcher (its groups checkpoint and stop: 143); killed after 120 s."""
        self.node.signal(signal.SIGTERM)
        try:
            return self.node.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.node.kill()
            return self.node.proc.returncode
        finally:
            self.node.kill()  # nothing of it left (a no-op once it ended cleanly)


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


def fault(run: ReplicaRun, signum: int, timeout: float = 180) -> Fault:
    """One fault of group 1's worker, measured; returns once the group trains again."""
    before, level = run.workers(), load()
    victim, count = before[VICTIM], run.ledger.poll()
    start = time.monotonic()
    os.kill(victim, signum)
    try:
        held = held_up(run, count, victim, signum == signal.SIGSTOP, timeout)
    finally:
        if signum == signal.SIGSTOP:
            os.kill(victim, signal.SIGCONT)
    back = rejoined(run, victim, signum == signal.SIGSTOP, timeout)
    more = len(run.ledger.groups) + 20
    run.ledger.wait(lambda n: n >= more, timeout, "20 more steps")
    return Fault(run.ledger.seen[held] - start, held - count, back - start, before,
                 run.workers(), level)


def held_up(run: ReplicaRun, count: int, victim: int, stopped: bool, timeout: float) -> int:
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


def rejoined(run: ReplicaRun, victim: int, resumed: bool, timeout: float) -> float:
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


def faults(work: Path, label: str, spares: int, signum: int, n: int) -> list[Fault]:
    run = ReplicaRun(work, label, spares)
    try:
        run.steady()
        out = []
        for i in range(n):
            if i:  # group 1 back for 50 steps in a row
                run.steady()
            out.append(f := fault(run, signum))
            skipped = f" ({f.in_flight} step in flight committed first)" if f.in_flight else ""
            print(f"({label}) fault {i + 1}: next step {f.next_step_s:.2f} s{skipped}, group "
                  f"{VICTIM} trains again {f.back_s:.2f} s; survivors' pids "
                  f"{_pids(f)} (load {f.load})", flush=True)
            time.sleep(2)
        return out
    finally:
        code = run.stop()
        if code != 143:
            print(f"({label}) run ended with {code}, not 143:\n{run.node.text()[-2000:]}")


def _pids(f: Fault) -> str:
    pairs = [f"{f.before[g]}->{f.after.get(g)}" for g in sorted(f.before) if g != VICTIM]
    return ", ".join(pairs) + (" unchanged" if f.survivors_unchanged else " CHANGED")


def restarts(work: Path, n: int) -> list[float]:
    """(d): bench/recovery.py's single-node restart, on the replica runs' model."""
    out = []
    for i in range(n):
        (work / str(i)).mkdir()
        cfg = write_config(work / str(i) / "restart.yaml", {**RESTART, "run": {"name": "d"}})
        level = load()
        out.append(single_node(work / str(i), [str(cfg)]))
        print(f"(d) fault {i + 1}: next step {out[-1]:.2f} s (load {level})", flush=True)
    return out


def rate(run: ReplicaRun, seconds: float) -> float:
    """Committed steps per second over the next ``seconds``."""
    start, first = time.monotonic(), run.ledger.poll()
    time.sleep(seconds)
    return (run.ledger.poll() - first) / (time.monotonic() - start)


def under_faults(run: ReplicaRun, minutes: float, rng: random.Random) -> tuple[float, int]:
    """(committed steps per second, faults sent) with a kill -9 every FAULT_EVERY_S."""
    start, first, sent = time.monotonic(), run.ledger.poll(), 0
    end = start + minutes * 60
    while (at := start + sent * FAULT_EVERY_S) < end:
        time.sleep(max(0.0, at - time.monotonic()))
        live = run.workers()
        group = rng.choice([g for g in live if g] or [None])
        if group is not None:
            os.kill(live[group], signal.SIGKILL)
            print(f"throughput: kill -9 of group {group}'s worker at "
                  f"{time.monotonic() - start:.0f} s (load {load()})", flush=True)
        sent += 1
        run.ledger.poll()
    time.sleep(max(0.0, end - time.monotonic()))
    return (run.ledger.poll() - first) / (time.monotonic() - start), sent


def throughput(work: Path, minutes: float) -> tuple[float, float, float]:
    """(fault-free before, under faults, fault-free after), committed steps per second."""
    run = ReplicaRun(work, "throughput", spares=1)
    try:
        run.steady()
        before = rate(run, REFERENCE_S)
        print(f"throughput: fault-free {before:.1f} steps/s (load {load()})", flush=True)
        faulty, _ = under_faults(run, minutes, random.Random(0))
        print(f"throughput: under faults {faulty:.1f} steps/s (load {load()})", flush=True)
        run.steady()
        time.sleep(15)  # a spare started last heals too
        after = rate(run, REFERENCE_S)
        print(f"throughput: fault-free again {after:.1f} steps/s (load {load()})", flush=True)
        return before, faulty, after
    finally:
        if (code := run.stop()) != 143:
            print(f"(throughput) run ended with {code}, not 143")


def report(name: str, values: list[float], base: float | None) -> None:
    m = statistics.median(values)
    ratio = f" ({m / base:.2f} x the restart)" if base else ""
    print(f"{name}: median {m:.2f} s, p95 {p95(values):.2f} s over {len(values)}{ratio}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=5, help="faults of each kind (>= 10 "
                        "for the issue's numbers)")
    parser.add_argument("--minutes", type=float, default=3, help="of faults every 30 s")
    parser.add_argument("--sigstop-only", action="store_true",
                        help="(c) alone, with the restart baseline (d)")
    args = parser.parse_args(argv)
    if args.sigstop_only:
        return sigstop_only(args.faults)
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        work = Path(tmp)
        for sub in ("a", "b", "c", "d", "t"):
            (work / sub).mkdir()
        print(f"load at the start {load()}", flush=True)
        a = faults(work / "a", "a", 1, signal.SIGKILL, args.faults)
        b = faults(work / "b", "b", 0, signal.SIGKILL, args.faults)
        c = faults(work / "c", "c", 1, signal.SIGSTOP, args.faults)
        d = restarts(work / "d", args.faults)
        before, faulty, after = throughput(work / "t", args.minutes)
    base = statistics.median(d)
    print(f"\nrecovery, a fault -> the next committed step (load at the end {load()}):")
    report("(d) restart, 2 processes, kill -9 one", d, None)
    for label, name, values in (("a", "2 groups + spare, kill -9 group 1", a),
                                ("b", "2 groups, no spare, kill -9 group 1", b),
                                ("c", "2 groups + spare, SIGSTOP group 1", c)):
        report(f"({label}) {name}", [f.next_step_s for f in values], base)
        report("    group 1 trains again", [f.back_s for f in values], base)
        same = sum(f.survivors_unchanged for f in values)
        print(f"    survivors' pids unchanged in {same} of {len(values)} faults")
    reference = (before + after) / 2
    print(f"throughput, 2 groups + spare, kill -9 every {FAULT_EVERY_S} s for "
          f"{args.minutes:g} min: {faulty:.1f} steps/s, {faulty / reference:.2f} x the "
          f"fault-free {reference:.1f} (before {before:.1f}: {faulty / before:.2f}, after "
          f"{after:.1f}: {faulty / after:.2f}); the restart "
          f"would lose {base:.1f} s of each {FAULT_EVERY_S} s: ~{1 - base / FAULT_EVERY_S:.2f}"
          " (estimated from (d), not measured)")
    return 0


def sigstop_only(n: int) -> int:
    """(c) and (d) alone: what a frozen group costs, against the restart."""
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        work = Path(tmp)
        for sub in ("c", "d"):
            (work / sub).mkdir()
        c = faults(work / "c", "c", 1, signal.SIGSTOP, n)
        d = restarts(work / "d", n)
    base = statistics.median(d)
    report("(d) restart, 2 processes, kill -9 one", d, None)
    report("(c) 2 groups + spare, SIGSTOP group 1", [f.next_step_s for f in c], base)
    report("    group 1 trains again", [f.back_s for f in c], base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
