"""Slow is not dead: nodes starved of CPU keep their place in an elastic job. Simulated
nodes (tests/harness/multinode.py: the real entrypoint, each node in its own PID
namespace where the kernel allows, all on 127.0.0.1) under the Indexed Job convention.

- A node whose every process is stopped (SIGSTOP: no CPU at all, the worst starvation)
  for longer than a vanished host takes to be noticed, then continued: its pulse socket
  still answered, so nobody was evicted, no round was added, training went on.
- Eight nodes started together on this machine while it is otherwise busy complete one
  rendezvous round and train (bench/rendezvous.py prints the time to step 1 for 2, 4 and
  8 nodes).

The fast side (a node that is killed or whose host vanishes is gone within seconds) is in
tests/e2e/test_k8s_sim_runs.py and tests/e2e/test_vanish.py; the rules in process in
tests/unit/test_pulse.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from tests.harness.multinode import SMALL_JOB, Cluster, first
from tests.harness.procs import descendants
from tests.harness.runs import clean_env

FROZEN_S = 15  # past the 8 s after which a member whose host is gone is evicted


def _complete_rounds(text: str) -> set[str]:
    return set(re.findall(r"rendezvous round (\d+) complete", text))


def test_a_node_stopped_for_a_while_keeps_its_place(tmp_path):
    cluster = Cluster(tmp_path, clean_env(), nnodes="1:2")
    # heartbeat_silence_s: room for the stopped node to beat again on a loaded machine
    args = [*SMALL_JOB, f"output.dir={tmp_path / 'runs'}", "distributed.heartbeat_silence_s=90"]
    try:
        cluster.start_store()
        nodes = [cluster.node(i, args).start() for i in range(2)]
        main = first(nodes, r"\]:step 20/", 300)
        assert "world size 2 " in main.text()
        other = nodes[1] if main is nodes[0] else nodes[0]
        tree = [other.proc.pid, *descendants(other.proc.pid)]
        # the rounds so far (the second node may have joined a round of its own at the
        # start, on a loaded machine): the freeze must not add one
        rounds = [_complete_rounds(node.text()) for node in nodes]
        for pid in tree:
            os.kill(pid, signal.SIGSTOP)
        try:
            main.wait_for(r"silent for \d+ s but its host answers .* keeps its place", 120)
            time.sleep(max(0.0, FROZEN_S - 8))
        finally:
            for pid in tree:
                os.kill(pid, signal.SIGCONT)
        steps_then = len(re.findall(r"\]:step \d+/", main.text()))
        deadline = time.monotonic() + 300
        while len(re.findall(r"\]:step \d+/", main.text())) < steps_then + 20:
            assert time.monotonic() < deadline, main.text()[-3000:]
            assert other.running and main.running
            time.sleep(0.5)
        for node, before in zip(nodes, rounds, strict=True):
            assert "left the job" not in node.text(), node.text()[-3000:]
            assert "went on without this node" not in node.text()
            assert _complete_rounds(node.text()) == before, node.text()[-3000:]
    finally:
        cluster.close()


def test_eight_nodes_on_a_busy_machine_meet_once_and_train(tmp_path):
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(4)]
    cluster = Cluster(tmp_path, clean_env(), nnodes="8")
    args = [*SMALL_JOB, f"output.dir={tmp_path / 'runs'}", "train.max_steps=3",
            "checkpoint.every_steps=0"]
    try:
        cluster.start_store()
        nodes = [cluster.node(i, args).start() for i in range(8)]
        main = first(nodes, r"\]:step 3/", 600)
        assert [node.wait(300) for node in nodes] == [0] * 8, main.text()[-3000:]
        # (step lines and INFO lines reach the log by different pipes: in no set order)
        assert "world size 8 " in main.text()
        for node in nodes:
            assert _complete_rounds(node.text()) == {"0"}, node.text()[-3000:]
            assert "left the job" not in node.text()
    finally:
        cluster.close()
        for p in busy:
            p.kill()
            p.wait()
