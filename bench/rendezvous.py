"""Time to step 1 for elastic jobs of 2, 4 and 8 nodes started together.

Simulated nodes (tests/harness/multinode.py: the real entrypoint, each node in its own
PID namespace where the kernel allows, pinned to a CPU, all on 127.0.0.1) under the
Indexed Job convention with the standalone store, every node one process of the small
job. Printed per node count: seconds from starting the nodes to the first training step,
how many rendezvous rounds completed on the way (1: nobody was dropped and rejoined), and
the ratio to one node alone started the same way in the same run. With ``--busy N``, N
spinning processes keep the machine otherwise busy (on 2 cores, 8 nodes are already 4 to
a core).

    python -m bench.rendezvous [--nodes 2 4 8] [--busy 4] [--runs 1]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.harness.multinode import SMALL_JOB, Cluster, first
from tests.harness.runs import clean_env


def to_step_one(work: Path, nnodes: int) -> tuple[float, int]:
    """(seconds from start to step 1, rendezvous rounds completed) for ``nnodes`` nodes."""
    cluster = Cluster(work, clean_env(), nnodes=str(nnodes))
    args = [*SMALL_JOB, f"output.dir={work / 'runs'}", "train.max_steps=2",
            "checkpoint.every_steps=0"]
    try:
        cluster.start_store()
        start = time.monotonic()
        nodes = [cluster.node(i, args).start() for i in range(nnodes)]
        main = first(nodes, rf"world size {nnodes}(.|\n)*\]:step 1/", 900)
        took = time.monotonic() - start
        rounds = len(set(re.findall(r"rendezvous round (\d+) complete", main.text())))
        for node in nodes:
            node.wait(300)
        return took, rounds
    finally:
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--busy", type=int, default=0, help="spinning processes meanwhile")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        results: dict[int, list[tuple[float, int]]] = {}
        for n in [1, *args.nodes]:
            for _ in range(args.runs):
                with tempfile.TemporaryDirectory(prefix="bench-rdzv-") as tmp:
                    results.setdefault(n, []).append(to_step_one(Path(tmp), n))
                took, rounds = results[n][-1]
                print(f"{n} node(s): step 1 after {took:.1f} s, {rounds} round(s), load "
                      f"{os.getloadavg()[0]:.0f}", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    base = statistics.median(t for t, _ in results[1])
    print(f"one node alone: {base:.1f} s to step 1 (1.00); {args.busy} busy process(es), "
          f"{len(os.sched_getaffinity(0))} CPU(s)")
    for n in args.nodes:
        took = statistics.median(t for t, _ in results[n])
        rounds = max(r for _, r in results[n])
        print(f"{n} nodes: {took:.1f} s to step 1 ({took / base:.2f} x one node), at most "
              f"{rounds} rendezvous round(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
