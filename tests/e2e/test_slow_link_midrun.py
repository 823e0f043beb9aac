"""A link that slows mid-run is named: three hosts in network namespaces
(tests/harness/netns.py), one process each, gloo over their bridge, one run reused for
each phase:

1. nothing changes: the communication wait's baseline is set and nothing is named;
2. every node's compute slows alike (the test's model sleeps in its forward pass while a
   flag file exists, as a busy machine would make it): nothing is named;
3. tc holds back everything node 2 sends (a token-bucket rate on a kernel without netem,
   a netem delay elsewhere): node 2, and no other node, is named once, on the console and
   in metrics.jsonl;
4. the qdisc removed: node 2 is said to keep pace again.

The detection rule and the verdict on the timing: tests/unit/test_slow_links_midrun.py.
Every wait below is a limit against a hang; phases are told apart by order (the step a
change was made at), never by how long anything took."""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

from tests.harness.multinode import Process
from tests.harness.runs import ENTRY, TINY_MLP, clean_env, limit, merge, write_config

SLOWFWD = '''
import os
import time

import torch


class Net(torch.nn.Module):
    """An MLP whose forward pass sleeps while the flag file exists: compute slows on
    every node alike."""

    def __init__(self, inputs, outputs, width, flag):
        super().__init__()
        self.flag = flag
        self.body = torch.nn.Sequential(torch.nn.Linear(inputs, width), torch.nn.ReLU(),
                                        torch.nn.Linear(width, width), torch.nn.ReLU(),
                                        torch.nn.Linear(width, outputs))

    def forward(self, x):
        if os.path.exists(self.flag):
            time.sleep(0.1)
        return self.body(x)


def build(inputs, outputs, width, flag):
    return Net(inputs, outputs, width, flag)
'''
NAMED = re.compile(r"slow link: node (\d) \((\w+)\) links ([\d.]+)x the other nodes'")
WINDOW = 14  # seconds of training per phase: the judge's window (10 s) and a margin


def rows(work: Path) -> list[dict]:
    return [json.loads(line) for path in (work / "runs").glob("*/metrics.jsonl")
            for line in path.read_text().splitlines() if line.strip()]


def last_step(work: Path) -> tuple[int, float]:
    """(the newest training row's step, its time)."""
    steps = [r for r in rows(work) if "loss" in r and "time" in r]
    return (steps[-1]["step"], steps[-1]["time"]) if steps else (0, 0.0)


def train_for(work: Path, node: Process, seconds: float) -> int:
    """Wait until the run has trained ``seconds`` more (by its own rows' times); the
    step it reached."""
    _, since = last_step(work)
    deadline = time.monotonic() + limit(240)
    while time.monotonic() < deadline:
        step, at = last_step(work)
        if since and at - since >= seconds:
            return step
        since = since or at
        assert node.proc.poll() is None, node.text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no {seconds} s of training within the limit:\n{node.text()[-3000:]}")


def test_a_node_whose_link_slows_mid_run_is_named_and_only_it(net, tmp_path):
    (tmp_path / "slowfwd.py").write_text(SLOWFWD)
    flag = tmp_path / "slow-compute"
    config = write_config(tmp_path / "job.yaml", merge(TINY_MLP, {
        "output": {"dir": str(tmp_path / "runs")},
        "model": {"kind": "custom", "factory": "slowfwd:build",
                  "args": {"inputs": 256, "outputs": 4, "width": 512, "flag": str(flag)}},
        "data": {"shape": [256], "num_samples": 4096},
        "train": {"max_steps": 100000, "global_batch_size": 12, "eval_every_steps": 0,
                  "eval_batches": 0},
        "checkpoint": {"every_steps": 0},
        "logging": {"every_steps": 2, "straggler_steps": 10, "straggler_ratio": 2.0},
        "distributed": {"preflight_slow_ratio": 0.2}}))
    hosts = [net.host(f"node{i}") for i in range(3)]
    nodes = []
    for rank, host in enumerate(hosts):
        env = clean_env(MASTER_ADDR="node0", MASTER_PORT="29500", WORLD_SIZE="3",
                        RANK=str(rank), TRAIN_LOCAL_ADDR=host.addr,
                        TRAIN_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
        nodes.append(host.process(f"node{rank}", [sys.executable, ENTRY, "train",
                                                  str(config)], env, tmp_path))
        net.procs.append(nodes[-1].start())
    main = nodes[0]
    try:
        main.wait_for(r"slow links: the communication wait is \d+ ms", 300)  # 1: baseline
        flag.touch()                                                          # 2: compute
        train_for(tmp_path, main, WINDOW)
        flag.unlink()
        train_for(tmp_path, main, WINDOW / 2)
        qdisc = net.slow_link(hosts[2], rate="20mbit")                        # 3: node 2
        throttled_at, _ = last_step(tmp_path)
        named = main.wait_for(NAMED.pattern, 240)
        net.fast_link(hosts[2])                                               # 4: again
        main.wait_for(r"slow link: node 2 \(node2\) keeps pace again at step \d+", 240)
    finally:
        net.fast_link(hosts[2])
        for node in nodes:
            node.signal(signal.SIGTERM)
        codes = [node.wait(120) for node in nodes]
    text = main.text()
    print(f"node 2 behind {qdisc} from step {throttled_at}: {named[0]}")
    assert (named[1], named[2]) == ("2", "node2") and float(named[3]) < 0.2, text[-3000:]
    events = [r for r in rows(tmp_path) if r.get("event", "").startswith("slow_link")]
    assert [(e["event"], e["node"], e["host"]) for e in events] == [
        ("slow_link", 2, "node2"), ("slow_link_over", 2, "node2")], events
    assert events[0]["step"] > throttled_at and events[1]["step"] > events[0]["step"]
    print(f"link check on rank 0: {events[0]['check_seconds']} s")
    assert codes == [143, 143, 143], codes  # stopped by the signal, as a user would
