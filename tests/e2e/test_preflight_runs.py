"""The preflight check before step 1, on two simulated nodes (tests/harness/multinode.py:
the real ``entrypoint.py train`` per node under the static convention, Kubeflow
PyTorchJob v1's variables, each node one process pinned to its own CPU, gloo on
127.0.0.1): a healthy pair gives the summary line and trains; a node whose matmul is
slow, or gives NaN, is named by rank 0 and, with ``fail``, ends the job with exit 3
before step 1; ``off`` says nothing. The rule itself: tests/unit/test_preflight.py.

A node is made slow or bad at its edge, the device: the model factory of the test's own
project (``faultymm``) replaces ``torch.mm`` in that node's worker, as a throttled or
faulty GPU would answer, before the check runs. The slow one takes twenty times as long
as the real matmul it wraps, so it is named even if the other node's CPU were three times
as busy; the healthy pair is judged with a ratio of 0.05, so that a busy machine cannot
make one of its nodes an outlier. The model's own layers do not call ``torch.mm``, so
training is unchanged.

A node whose links are slow is made so at its edge too, its network interface: three
hosts in network namespaces (tests/harness/netns.py), tc holding back everything one of
them sends (a netem delay, or a token-bucket rate on a kernel without netem); the silent
control with every link alike, and the rule, are in tests/unit/test_preflight_links.py.
"""

from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path

from launcher.detection.system import free_port
from tests.harness.multinode import Process, pid_namespaces
from tests.harness.runs import ENTRY, TINY_MLP, clean_env, limit, merge, write_config

FAULTY = '''
import os
import time

import torch


def _install(fault, rank):
    if os.environ.get("RANK") != str(rank) or "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # not that node's worker under torchrun
    real = torch.mm

    def nan(a, b):
        return real(a, b).fill_(float("nan"))

    def slow(a, b):
        start = time.perf_counter()
        out = real(a, b)
        time.sleep(19 * (time.perf_counter() - start))  # twenty times as long in all
        return out

    def hang(a, b):
        time.sleep(3600)  # a device that never answers

    torch.mm = {"nan": nan, "slow": slow, "hang": hang}[fault]


def build(inputs, outputs, width, fault=None, rank=1):
    if fault:
        _install(fault, rank)
    return torch.nn.Sequential(torch.nn.Linear(inputs, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, outputs))
'''
STEPS = 4


def start_pair(work: Path, fault: str | None = None, *overrides: str) -> list[Process]:
    """Two nodes of one static job (one process each), ``fault`` on node 1."""
    (work / "faultymm.py").write_text(FAULTY)
    args = {"inputs": 16, "outputs": 4, "width": 32, "fault": fault}
    config = write_config(work / "job.yaml", merge(TINY_MLP, {
        "output": {"dir": str(work / "runs")},
        "model": {"kind": "custom", "factory": "faultymm:build", "args": args},
        "train": {"max_steps": STEPS, "eval_batches": 0}}))
    port = free_port()
    namespaces = pid_namespaces()
    pods = []
    for rank in range(2):
        env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                        RANK=str(rank), OMP_NUM_THREADS="1")
        pods.append(Process(f"pod{rank}", [sys.executable, ENTRY, "train", str(config),
                                           *overrides], env, work, cpus={rank % 2},
                            namespace=namespaces).start())
    return pods


def finish(pods: list[Process]) -> list[int]:
    try:
        return [p.wait(300) for p in pods]
    finally:
        for p in pods:
            if p.running:
                p.kill()


def checks(work: Path) -> list[dict]:
    return json.loads((work / "runs" / "job" / "preflight.json").read_text())["checks"]


def test_a_healthy_pair_gets_the_summary_line_and_trains(tmp_path):
    pods = start_pair(tmp_path, None, "distributed.preflight_slow_ratio=0.05")
    assert finish(pods) == [0, 0], pods[0].text()[-3000:]
    out = pods[0].text()
    m = re.search(r"preflight: 2 ranks on 2 nodes in [\d.]+ s: matmul [\d.-]+ [GT]FLOP/s, "
                  r"all-reduce 1 MiB [\d.-]+ ms, links 1 MiB [\d.]+ [MG]B/s", out)
    assert m, out[-3000:]  # two nodes: their one link timed (naming needs three)
    print(m[0])  # the measurement, in the test's output
    [check] = checks(tmp_path)
    assert check["mode"] == "warn" and check["slow_ratio"] == 0.05
    assert check["problems"] == [] and check["summary"] in m[0]
    assert [(r["rank"], r["node"]) for r in check["ranks"]] == [(0, 0), (1, 1)]


def test_a_slow_node_is_named_and_training_goes_on_with_warn(tmp_path):
    pods = start_pair(tmp_path, "slow")
    assert finish(pods) == [0, 0], pods[0].text()[-3000:]
    out = pods[0].text()
    m = re.search(r"WARNING preflight: node 1 \(([^)]+)\) matmul (0\.\d\d)x the median "
                  r"\(([\d.]+) vs ([\d.]+) GFLOP/s\)", out)
    assert m, out[-3000:]
    assert m[1] == socket.gethostname() and float(m[2]) < 0.5
    assert "preflight: 2 ranks" not in out  # no summary when something is wrong
    assert f"step {STEPS}/{STEPS}" in out
    [check] = checks(tmp_path)
    assert check["problems"] == [m[0].split("WARNING ", 1)[1]]


def test_a_node_whose_matmul_gives_nan_ends_the_job_before_step_1_with_fail(tmp_path):
    pods = start_pair(tmp_path, "nan", "distributed.preflight=fail")
    assert finish(pods) == [3, 3], pods[0].text()[-3000:]
    for pod in pods:  # every node's last line names the bad one
        last = pod.text().strip().splitlines()[-1]
        assert last.startswith(f"error: preflight: node 1 ({socket.gethostname()}) matmul "
                               "gave NaN; distributed.preflight=fail: nothing was trained; "
                               "leave the node out"), pod.text()[-3000:]
        assert "kubectl cordon" in last and "--exclude" in last
        assert "step 1/" not in pod.text()
    run = tmp_path / "runs" / "job"
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    [check] = checks(tmp_path)
    assert check["mode"] == "fail" and check["ranks"][1]["nonfinite"] == "NaN"


def test_off_checks_nothing_and_says_nothing(tmp_path):
    pods = start_pair(tmp_path, "nan", "distributed.preflight=off")
    assert finish(pods) == [0, 0], pods[0].text()[-3000:]
    for pod in pods:
        assert "preflight:" not in pod.text()
    assert not (tmp_path / "runs" / "job" / "preflight.json").exists()


def test_a_rank_stuck_in_its_matmul_is_named_by_the_hang_watchdog(tmp_path):
    """Each repetition is a part of the watched preflight phase: 80 % of a 20 s
    distributed.timeout_s here (120 s by default), not the collective's whole timeout."""
    pods = start_pair(tmp_path, "hang", "distributed.timeout_s=20")
    assert finish(pods) == [1, 1], pods[1].text()[-3000:]
    last = pods[1].text().strip().splitlines()[-1]
    assert re.search(r"rank 1 hung: no progress for \d+ s in the preflight check before "
                     r"training \(80% of distributed.timeout_s: 16 s\): stuck in its own code "
                     r"at faultymm.py:\d+ in hang", last), pods[1].text()[-3000:]
    other = pods[0].text().strip().splitlines()[-1]  # the stuck rank's end, or its own wait
    assert "lost the connection to the worker at 127.0.0.1:" in other or \
        "waiting for the other ranks" in other, pods[0].text()[-3000:]
    assert "step 1/" not in pods[0].text() + pods[1].text()


def test_a_node_behind_a_slow_link_is_named_and_with_fail_nothing_trains(net, tmp_path):
    """Three nodes of a static job, node 2's interface held back from the start: every
    node exits 3 before step 1 naming node 2's links, and no other node. (A matmul
    ratio of 0.1: three nodes on two busy cores must not make a matmul the outlier.)"""
    config = write_config(tmp_path / "job.yaml", merge(TINY_MLP, {
        "output": {"dir": str(tmp_path / "runs")},
        "train": {"max_steps": STEPS, "eval_batches": 0, "global_batch_size": 12}}))
    hosts = [net.host(f"node{i}") for i in range(3)]
    qdisc = net.slow_link(hosts[2])
    try:
        nodes = []
        for rank, host in enumerate(hosts):
            env = clean_env(MASTER_ADDR="node0", MASTER_PORT="29500", WORLD_SIZE="3",
                            RANK=str(rank), TRAIN_LOCAL_ADDR=host.addr,
                            TRAIN_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
            nodes.append(host.process(f"node{rank}", [
                sys.executable, ENTRY, "train", str(config), "distributed.preflight=fail",
                "distributed.preflight_slow_ratio=0.1"], env, tmp_path))
            net.procs.append(nodes[-1].start())
        codes = [p.wait(limit(300)) for p in nodes]
    finally:
        net.fast_link(hosts[2])
    assert codes == [3, 3, 3], nodes[0].text()[-3000:]
    for node in nodes:
        last = node.text().strip().splitlines()[-1]
        # "6.0 vs 900 MB/s", or with a unit each when they differ: "6.0 MB/s vs 1.1 GB/s"
        assert re.match(r"error: preflight: node 2 \(node2\) links 0\.\d\dx the other nodes' "
                        r"\([\d.]+( [MG]B/s)? vs [\d.]+ [MG]B/s each way, its fastest of 2 "
                        r"peer nodes\); distributed.preflight=fail: nothing was trained", last), \
            node.text()[-3000:]
        assert "node 0" not in last and "node 1" not in last and "step 1/" not in node.text()
    [check] = checks(tmp_path)
    print(f"node 2 behind {qdisc}: {check['problems']}")
    assert [len(r["links"]) for r in check["ranks"]] == [2, 2, 2]
