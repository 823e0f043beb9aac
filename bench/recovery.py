"""Recovery time: from losing a worker or a node to the next training step.

Three measurements with the real entrypoint on 127.0.0.1 (simulated nodes from
tests/harness/multinode.py: each node in its own PID namespace where the kernel allows, pinned
to its own CPU):

- single node, 2 processes: kill -9 one worker -> torchrun restarts both -> next step;
- two nodes (``TRAIN_NNODES=1:2``, the standalone store): kill one node -> the
  survivor's next step;
- a replacement node started -> the next step at world size 2;
- two nodes on hosts of their own (tests/harness/netns.py, where this machine allows network
  namespaces): one host vanishes (its link down: no connection is closed) -> the
  survivor notices it, and -> trains again (its next step).

Each is the median of ``--runs`` runs, printed in seconds and as a ratio to the
single-node restart. Every wait is bounded; nothing is left running, and every process
is gone before its files are removed.

    python -m bench.recovery [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tests.harness import netns
from tests.harness.multinode import SMALL_JOB, Cluster, Process
from tests.harness.procs import cmdline, descendants
from tests.harness.runs import ENTRY, clean_env

STEP = r"\]:step \d+/"


def first(nodes: list[Process], pattern: str, timeout: float = 240) -> Process:
    deadline = time.monotonic() + timeout
    while True:
        for node in nodes:
            if re.search(pattern, node.text()):
                return node
        if time.monotonic() > deadline:
            sys.exit(f"no {pattern!r} within {timeout} s:\n{nodes[0].text()[-2000:]}")
        time.sleep(0.05)


def single_node(work: Path, job: Sequence[str] = tuple(SMALL_JOB)) -> float:
    """Seconds from kill -9 of one of 2 workers to the first step after the restart
    (``job``: the arguments of ``entrypoint.py train``; a checkpoint before step 30, a
    line per step)."""
    node = Process("single", [sys.executable, ENTRY, "train", *job,
                              "distributed.nproc_per_node=2", f"output.dir={work / 'runs'}"],
                   clean_env(), work).start()
    try:
        first([node], r"\]:step 30/")
        workers = [p for p in descendants(node.proc.pid) if "train.worker" in cmdline(p)]
        start = time.monotonic()
        os.kill(max(workers), signal.SIGKILL)
        first([node], r"resumed from (.|\n)*" + STEP)
        return time.monotonic() - start
    finally:
        node.kill()


def two_nodes(work: Path) -> tuple[float, float]:
    cluster = Cluster(work, clean_env(), nnodes="1:2")
    args = [*SMALL_JOB, f"output.dir={work / 'runs'}"]
    try:
        cluster.start_store()
        nodes = [cluster.node(i, args).start() for i in range(2)]
        main = first(nodes, r"world size 2(.|\n)*\]:step 30/")
        lost = nodes[1] if main is nodes[0] else nodes[0]
        start = time.monotonic()
        lost.kill()
        first([main], r"resumed from .*now 1\)(.|\n)*" + STEP)
        shrink = time.monotonic() - start
        start = time.monotonic()
        back = cluster.node(1, args).start()
        first([main, back], r"now 2\)(.|\n)*" + STEP)
        return shrink, time.monotonic() - start
    finally:
        cluster.close()


def host_vanished(work: Path, job: Sequence[str] = tuple(SMALL_JOB)) -> tuple[float, float]:
    """(seconds to notice, seconds to the survivor's next step) after a host vanished
    (``job``: as for :func:`single_node`)."""
    net = netns.Network(work)
    procs: list[Process] = []
    try:
        store_host, hosts = net.host("store"), [net.host("node0"), net.host("node1")]
        store = store_host.process("store", [sys.executable, ENTRY, "rendezvous", "--port",
                                             "29400", "--host", store_host.addr],
                                   clean_env(), work).start()
        procs.append(store)
        store.wait_for(r"listening on", 90)
        for i, h in enumerate(hosts):
            env = clean_env(JOB_COMPLETION_INDEX=str(i), TRAIN_NNODES="1:2",
                            TRAIN_RDZV_ID="job-1", TRAIN_RDZV_ENDPOINT="store:29400",
                            TRAIN_LOCAL_ADDR=h.addr, TRAIN_SOCKET_IFNAME="eth0")
            procs.append(h.process("train", [sys.executable, ENTRY, "train", *job,
                                             f"output.dir={work / 'runs'}"], env, work).start())
        main = procs[1]
        first([main], r"world size 2(.|\n)*\]:step 30/")
        start = time.monotonic()
        net.cut(hosts[1])
        first([main], r"left the job")
        noticed = time.monotonic() - start
        first([main], r"resumed from .*now 1\)(.|\n)*" + STEP)
        return noticed, time.monotonic() - start
    finally:
        for p in procs:
            if p.running:
                p.kill()
        net.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    vanish_why = netns.available()
    single, shrink, join, noticed, vanished = [], [], [], [], []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
            work = Path(tmp)
            for sub in "abc":
                (work / sub).mkdir()
            single.append(single_node(work / "a"))
            s, j = two_nodes(work / "b")
            shrink.append(s)
            join.append(j)
            if vanish_why is None:
                n, v = host_vanished(work / "c")
                noticed.append(n)
                vanished.append(v)
        print(f"run {i + 1}: single node {single[-1]:.1f} s, node lost {shrink[-1]:.1f} s, "
              f"node joined {join[-1]:.1f} s" + (f", host vanished: noticed {noticed[-1]:.1f} "
                                                 f"s, next step {vanished[-1]:.1f} s"
                                                 if vanished else ""), flush=True)
    base = statistics.median(single)
    print(f"median of {args.runs}: single-node restart {base:.1f} s (1.00)")
    rows = [("2 nodes, one killed -> survivor's next step", shrink),
            ("replacement started -> next step at world size 2", join)]
    if vanished:
        rows += [("2 nodes, one host vanished -> noticed", noticed),
                 ("2 nodes, one host vanished -> survivor's next step", vanished)]
    else:
        print(f"host vanished: not measured ({vanish_why})")
    for name, values in rows:
        m = statistics.median(values)
        print(f"median of {args.runs}: {name}: {m:.1f} s ({m / base:.2f} x the single-node "
              "restart)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
