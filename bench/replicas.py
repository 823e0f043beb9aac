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
``--faults 10 --minutes 10`` on an idle machine. How a fault is measured:
bench/replica_faults.py; the same faults with a host per group (and a frozen host, a cut
link): bench/replicas_rig.py.

    python -m bench.replicas [--faults 5] [--minutes 3] [--sigstop-only]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.recovery import single_node
from bench.replica_faults import Fault, LedgerWatch, Watched, fault, load, report, series, summary
from tests.harness.multinode import Process
from tests.harness.procs import replica_workers
from tests.harness.runs import ENTRY, clean_env, write_config

FAULT_EVERY_S = 30
REFERENCE_S = 60
MODEL = {"model": {"kind": "mlp"}, "data": {"kind": "synthetic", "num_workers": 0},
         "train": {"max_steps": 10_000_000, "global_batch_size": 16}}
REPLICAS = {**MODEL, "logging": {"every_steps": 1000, "progress": "plain"},
            "checkpoint": {"every_steps": 1000}}
# bench/recovery.py's single-node restart, on the same model: a line per step, a
# checkpoint before the kill at step 30
RESTART = {**MODEL, "logging": {"every_steps": 1, "progress": "plain"},
           "checkpoint": {"every_steps": 20}}


def replica_config(work: Path, name: str, spares: int) -> Path:
    """The config of a replica run: 2 groups + ``spares``, its run folder ``work/runs``."""
    return write_config(work / f"{name}.yaml", {
        **REPLICAS, "run": {"name": name}, "output": {"dir": str(work / "runs")},
        "distributed": {"fault_tolerance": "replicas", "replicas": 2, "spares": spares,
                        "max_restarts": 1000}})


class ReplicaRun(Watched):
    """``entrypoint.py train`` with replica groups on this machine, until stopped."""

    def __init__(self, work: Path, name: str, spares: int):
        self.groups = 2 + spares
        cfg = replica_config(work, name, spares)
        self.node = Process(name, [sys.executable, ENTRY, "train", str(cfg)], clean_env(),
                            work).start()
        self.ledger = LedgerWatch(work / "runs" / name / "ledger.jsonl")

    def workers(self) -> dict[int, int]:
        return replica_workers(self.node.proc.pid)

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


def faults(work: Path, label: str, spares: int, signum: int, n: int) -> list[Fault]:
    run = ReplicaRun(work, label, spares)
    try:
        return series(run, label, n, lambda: fault(run, signum))
    finally:
        code = run.stop()
        if code != 143:
            print(f"({label}) run ended with {code}, not 143:\n{run.node.text()[-2000:]}")


def restarts(work: Path, n: int, label: str = "d",
             one: Callable[[Path, list[str]], float] = single_node) -> list[float]:
    """(d): today's restart, ``n`` times on the replica runs' model: ``one(work, job)``,
    a fault's seconds to the next step (bench/recovery.py's single-node restart)."""
    out = []
    for i in range(n):
        (work / str(i)).mkdir()
        cfg = write_config(work / str(i) / "restart.yaml", {**RESTART, "run": {"name": label}})
        level = load()
        out.append(one(work / str(i), [str(cfg)]))
        print(f"({label}) fault {i + 1}: next step {out[-1]:.2f} s (load {level})", flush=True)
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
        summary(f"({label}) {name}", values, base)
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
    summary("(c) 2 groups + spare, SIGSTOP group 1", c, base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
