"""Replica groups on a real SLURM cluster (tests/harness/slurmcluster.py) of 4 nodes: an
sbatch of 2 nodes, one task per node (``srun --ntasks-per-node=1``),
``distributed.replicas=2`` (and of 3 with ``distributed.spares=1``):
each node's launcher runs one group (REPLICA_GROUP_ID = SLURM_NODEID), node 0's also
the Lighthouse at node1's address. A worker of node 2's group killed with SIGKILL: its
torchrun restarts it, it heals from node 1's group over the (virtual) network, and node
1's worker trains on in the same process; the job completes, and ``ledger.jsonl`` lists
every sample exactly once. A group that gives up (node 1's: no restarts left) ends its
node's task only: node 2's group trains on to the end, under node 1's Lighthouse. A lost
Lighthouse (kill -9 on node 1): one line on each node naming it, each exits 1. Groups
of two nodes each (4 nodes, ``distributed.replicas=2``): a worker of node 4 killed, its
group restarts on its two nodes (its own rendezvous at node 3) and heals from the other,
whose workers on nodes 1 and 2 train on in the same processes; then group 1's rank 1
frozen (SIGSTOP): its rank 0 sees it silent and leaves, and the group restarts and heals
again; then ``scancel --signal=TERM``: one stop step, one checkpoint, every task 143.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from launcher.detection.torchft_tools import lighthouse_binary
from tests.harness.procs import cmdline, environ, pids
from tests.harness.runs import ENTRY, NO_GPU, clean_env, limit, wait_for, write_config
from tests.harness.slurmcluster import FINISHED, SlurmCluster
from train.observe.ledger import check_exactly_once, read

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None or lighthouse_binary() is None,
    reason="needs torchft and its torchft_lighthouse (make ft)")

STEPS = 600


@pytest.fixture(scope="module")
def cluster(slurm_cluster4):
    return slurm_cluster4


def workers(job: int) -> dict[int, int]:
    """Replica group -> the pid of its worker, found by the variables slurm and the
    launcher gave it."""
    found = {}
    for pid in pids():
        env = environ(pid)
        if env.get("SLURM_JOB_ID") == str(job) and "REPLICA_GROUP_ID" in env and \
                "train.worker" in cmdline(pid):
            found[int(env["REPLICA_GROUP_ID"])] = pid
    return found


def workers_by_node(job: int) -> dict[str, int]:
    """Node name -> the pid of its worker (one process per node)."""
    found = {}
    for pid in pids():
        env = environ(pid)
        if env.get("SLURM_JOB_ID") == str(job) and "REPLICA_GROUP_ID" in env and \
                "train.worker" in cmdline(pid):
            found[env.get("SLURMD_NODENAME")] = pid
    return found


def ledger_lines(run_dir) -> int:
    return len(read(run_dir / "ledger.jsonl")) if (run_dir / "ledger.jsonl").exists() else 0


def submit(cluster: SlurmCluster, name: str, *overrides: str, nodes: int = 2
           ) -> tuple[int, Path, Path]:
    """A job of ``nodes`` nodes (node1 first), one task per node, one replica group each:
    (its id, its output, its run directory)."""
    cfg = write_config(cluster.work / f"{name}.yaml", {
        "run": {"name": name}, "output": {"dir": str(cluster.work / "runs")},
        "model": {"kind": "mlp"}, "data": {"kind": "synthetic", "num_workers": 0},
        "train": {"max_steps": STEPS, "global_batch_size": 16},
        "logging": {"every_steps": 200}, "checkpoint": {"every_steps": 200},
        "distributed": {"fault_tolerance": "replicas", "replicas": 2, "max_restarts": 3}})
    out = cluster.work / f"{name}.out"
    script = cluster.work / f"{name}.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH -N{nodes} -w node[1-{nodes}] --ntasks-per-node=1\n"
                      f"#SBATCH -o {out}\nset -euo pipefail\n"
                      f"srun --label --kill-on-bad-exit=0 {sys.executable} {ENTRY} train {cfg} "
                      + " ".join(overrides) + "\n")
    env = {**clean_env(), **NO_GPU, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    job = cluster.sbatch(script, env=env)
    run_dir = cluster.work / "runs" / name
    wait_for(lambda: ledger_lines(run_dir) >= 20, limit(300), "20 committed steps")
    return job, out, run_dir


def finished(cluster: SlurmCluster, job: int) -> None:
    if cluster.state(job) not in FINISHED:
        cluster.scancel(job)


@pytest.mark.parametrize("spares", [0, 1])
def test_a_killed_worker_on_one_node_heals_while_the_others_train_on(cluster: SlurmCluster,
                                                                     spares: int):
    job, out, run_dir = submit(cluster, f"replicas-{spares}", f"distributed.spares={spares}",
                               nodes=2 + spares)
    try:
        before = workers(job)
        assert sorted(before) == list(range(2 + spares)), before
        assert environ(before[1]).get("SLURMD_NODENAME") == "node2"
        os.kill(before[1], signal.SIGKILL)
        at_kill = ledger_lines(run_dir)
        wait_for(lambda: ledger_lines(run_dir) >= at_kill + 20, limit(300),
                 "20 more committed steps after the kill")
        after = workers(job)
        assert all(after.get(g) == before[g] for g in before if g != 1), (before, after)
        assert cluster.wait_job(job, limit(600)) == "COMPLETED", out.read_text()[-4000:]
    finally:
        finished(cluster, job)
    text = out.read_text()
    assert "torchrun (replica group 1): rank 0 killed by SIGKILL" in text, text[-4000:]
    assert "--bind node1:" in text and "(the Lighthouse, pid" in text, text[-4000:]
    assert "waiting for node 0's Lighthouse at http://node1:" in text, text[-4000:]
    assert f"this node runs replica group 1 of {2 + spares}" in text, text[-4000:]
    entries = read(run_dir / "ledger.jsonl")
    assert [e.step for e in entries] == list(range(1, STEPS + 1))
    assert check_exactly_once(entries) == []
    if spares:  # the spare on node3 took the lost group's slot
        assert (0, 2) in {tuple(e.replicas) for e in entries}


def test_node_1s_group_giving_up_leaves_node_2s_training_to_the_end(cluster: SlurmCluster):
    job, out, run_dir = submit(cluster, "gave-up", "distributed.max_restarts=0")
    try:
        os.kill(workers(job)[0], signal.SIGKILL)
        assert cluster.wait_job(job, limit(600)) == "FAILED", out.read_text()[-4000:]
    finally:
        finished(cluster, job)
    text = out.read_text()
    assert "0: entrypoint: replica group 0 gave up after 0 restart(s)" in text, text[-4000:]
    assert "keeping the Lighthouse up while the other nodes' groups beat" in text
    assert "task 0: Exited with exit code 1" in text and "task 1: Exited" not in text
    entries = read(run_dir / "ledger.jsonl")
    assert [e.step for e in entries] == list(range(1, STEPS + 1))
    assert check_exactly_once(entries) == []


def test_a_lost_lighthouse_is_one_line_on_each_node_and_each_exits_1(cluster: SlurmCluster):
    job, out, _ = submit(cluster, "lost-lighthouse")
    try:
        found = [pid for pid in pids() if "torchft_lighthouse" in cmdline(pid)
                 and environ(pid).get("SLURM_JOB_ID") == str(job)]
        assert len(found) == 1, found
        os.kill(found[0], signal.SIGKILL)
        assert cluster.wait_job(job, limit(120)) == "FAILED", out.read_text()[-4000:]
    finally:
        finished(cluster, job)
    text = out.read_text()
    lines = [ln for ln in text.splitlines() if "error: training failed: the Lighthouse" in ln]
    assert len(lines) == 2, text[-4000:]
    # (its pid in node1's PID namespace, not this host's)
    assert any(ln.startswith("0: ") and "exited with code -9" in ln for ln in lines), lines
    assert any(ln.startswith("1: ") and "(node 0's, http://node1:" in ln and
               "stopped accepting connections" in ln for ln in lines), lines
    assert "scontrol requeue" in lines[0]
    assert "task 0: Exited with exit code 1" in text and "task 1: Exited with exit code 1" in text


def test_a_group_of_two_nodes_restarts_on_its_nodes_and_rejoins_the_other_training_on(
        cluster: SlurmCluster):
    job, out, run_dir = submit(cluster, "two-node-groups", "train.max_steps=10000000",
                               nodes=4)
    try:
        first = workers_by_node(job)
        assert sorted(first) == ["node1", "node2", "node3", "node4"], first
        assert environ(first["node4"])["REPLICA_GROUP_ID"] == "1"
        # 1. a worker of group 1 killed
        os.kill(first["node4"], signal.SIGKILL)
        second = group_1_back(job, run_dir, first)
        # 2. group 1's rank other than its rank 0 frozen: its rank 0, whose Manager
        # beats for the group, sees it silent and leaves; the group restarts again
        frozen = next(n for n in ("node3", "node4") if environ(second[n])["RANK"] != "0")
        os.kill(second[frozen], signal.SIGSTOP)
        third = group_1_back(job, run_dir, second)
        cluster.scancel(job, signal="TERM")  # a stop with a checkpoint: a whole ledger
        cluster.wait_job(job, limit(300))
    finally:
        finished(cluster, job)
    # group 0 (nodes 1, 2) untouched by both faults
    assert [third[n] for n in ("node1", "node2")] == [first["node1"], first["node2"]]
    text = out.read_text()
    assert "this node runs its part of replica group 1 of 2 (nodes 2..3, 2 per group; " \
           "this is the group's node 1)" in text, text[-4000:]
    assert re.search(r"3: .*torchrun \(replica group 1\): rank \d on node4 killed by "
                     r"SIGKILL", text), text[-4000:]
    assert re.search(rf"replica group 1: rank 1 \({frozen}\) has been silent for", text), \
        text[-4000:]
    assert len(re.findall(r"\[rank 0\] INFO replica group 1 healed from a live peer",
                          text)) == 2, text[-4000:]
    # the stop reached every process of the step, the Lighthouse too, which outlives it:
    # every worker stopped at the same step, group 0 wrote the checkpoint, none was killed
    stops = set(re.findall(r"\[rank \d\] WARNING stopped at step (\d+) by a signal", text))
    assert len(stops) == 1 and text.count("stopped at step") == 4, text[-4000:]
    assert re.search(rf"0: .*checkpoint saved: .*step-{stops.pop()}\n", text), text[-4000:]
    assert "confirmed their checkpoint" not in text, text[-4000:]
    entries = read(run_dir / "ledger.jsonl")
    assert [e.step for e in entries] == list(range(1, len(entries) + 1))
    assert check_exactly_once(entries) == []


def group_1_back(job: int, run_dir: Path, before: dict[str, int]) -> dict[str, int]:
    """After a fault of group 1: its new workers on nodes 3 and 4, and the ledger showing
    group 0 alone in both slots, then both groups again; the workers then."""
    at = ledger_lines(run_dir)

    def back() -> bool:
        now = workers_by_node(job)
        return len(now) == 4 and now["node3"] != before["node3"] and \
            now["node4"] != before["node4"] and rejoined(run_dir, at)
    wait_for(back, limit(300), "replica group 1 back on nodes 3 and 4, in the quorum")
    return workers_by_node(job)


def rejoined(run_dir: Path, after: int) -> bool:
    """Whether, after the first ``after`` steps, group 0 trained group 1's slot too and
    then both trained again."""
    replicas = [tuple(e.replicas) for e in read(run_dir / "ledger.jsonl")[after:]]
    return (0, 0) in replicas and (0, 1) in replicas[replicas.index((0, 0)):]
