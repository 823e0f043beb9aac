"""Hosts that vanish: power loss, a kernel panic, a partitioned switch. No connection is
closed, so nothing tells the other nodes but silence. Each node is a host of its own
(tests/harness/netns.py: network, PID, UTS and mount namespaces on one bridge); a host vanishes
when its link goes down, its processes untouched, and may come back.

What must hold (time bounds are generous limits for a loaded 2-core machine, not
tunings; bench/recovery.py measures the real figures):
- elastic: the survivors notice the silent node and train again without it, from the
  last checkpoint; a healed node joins again, never trains in a world of its own;
- static: every surviving node exits 1 promptly, naming the lost node;
- the rendezvous store's host vanishing: training goes on while no re-rendezvous is
  needed; one that is needed waits distributed.rdzv_store_wait_s, then exit 5;
- two nodes that lose each other while both still reach the store (nothing the store
  sees changes), in a step or a checkpoint: their launchers name the partition within a
  minute (every node's ranks wait for the others in the same step), with the default
  distributed.timeout_s, and once the partition heals the job trains to its end from the
  last sealed checkpoint.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from tests.harness.multinode import ENTRY, Process
from tests.harness.runs import ROOT, TINY_MLP, clean_env, limit, merge, write_config

SMALL = [str(ROOT / "configs" / "quickstart.yaml"), "model.depth=1", "model.width=32",
         "model.heads=4", "model.context_length=32", "train.global_batch_size=12",
         "data.max_bytes=200000", "data.num_workers=0", "train.eval_batches=1",
         "logging.every_steps=1", "logging.progress=plain", "train.max_steps=100000",
         "checkpoint.every_steps=10"]
STEP = re.compile(r"step (\d+)/")


def start(net, host, label: str, argv: list[str], env: dict, work: Path) -> Process:
    p = host.process(label, argv, env, work).start()
    net.procs.append(p)
    return p


def elastic_job(net, work: Path, nodes: int, nnodes: str, *extra: str,
                config: Path | None = None):
    store_host = net.host("store")
    hosts = [net.host(f"node{i}") for i in range(nodes)]
    store = start(net, store_host, "store", [sys.executable, ENTRY, "rendezvous", "--port",
                                              "29400", "--host", store_host.addr],
                  clean_env(), work)
    store.wait_for(r"listening on", 90)
    procs = []
    for i, h in enumerate(hosts):
        env = clean_env(JOB_COMPLETION_INDEX=str(i), TRAIN_NNODES=nnodes, TRAIN_RDZV_ID="job-1",
                        TRAIN_RDZV_ENDPOINT="store:29400", TRAIN_LOCAL_ADDR=h.addr,
                        TRAIN_SOCKET_IFNAME="eth0")
        what = [str(config)] if config is not None else SMALL
        procs.append(start(net, h, "train", [sys.executable, ENTRY, "train", *what,
                                             f"output.dir={work / 'runs'}", *extra], env, work))
    return store_host, store, hosts, procs


def steps_after(p: Process, marker: str) -> list[int]:
    text = p.text()
    at = text.rfind(marker)
    return [int(s) for s in STEP.findall(text[at:])] if at >= 0 else []


def test_elastic_survivors_train_again_without_a_vanished_node_which_rejoins(net, tmp_path):
    _, _, hosts, nodes = elastic_job(net, tmp_path, 3, "1:3")
    nodes[0].wait_for(r"\| world size 3 \|", 300)
    nodes[0].wait_for(r"checkpoint saved", 120)
    net.cut(hosts[2])
    cut = time.monotonic()
    nodes[0].wait_for(r"left the job \(.*its host is down or cut off\)", 60)
    noticed = time.monotonic() - cut
    resumed = nodes[0].wait_for(r"resumed from .* now 2\)", 120)
    deadline = time.monotonic() + limit(60)
    while not steps_after(nodes[0], resumed[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    trains_again = time.monotonic() - cut
    assert steps_after(nodes[0], resumed[0]), nodes[0].text()[-3000:]
    assert trains_again < 120, f"the survivors trained again {trains_again:.0f} s after the loss"
    print(f"vanished node noticed after {noticed:.1f} s, training again after "
          f"{trains_again:.1f} s")
    time.sleep(max(0.0, 60 - (time.monotonic() - cut)))  # a partition of a minute, then heal
    net.heal(hosts[2])
    healed = time.monotonic()
    deadline = healed + limit(240)
    def worlds_of_3() -> int:  # the trainer's start line, once per world it trains in
        return len(re.findall(r"\| world size 3 \|", nodes[0].text()))
    while time.monotonic() < deadline:
        if worlds_of_3() >= 2 or not nodes[2].running:
            break
        time.sleep(0.5)
    rejoined = worlds_of_3() >= 2
    assert rejoined, nodes[2].text()[-3000:]
    assert "now 1)" not in nodes[2].text(), "the healed node trained in a world of its own"
    print(f"healed node {'rejoined' if rejoined else 'exited'} "
          f"{time.monotonic() - healed:.1f} s after the heal")


def test_static_nodes_exit_naming_the_vanished_node(net, tmp_path):
    hosts = [net.host(f"node{i}") for i in range(3)]
    nodes = []
    for i, h in enumerate(hosts):
        env = clean_env(MASTER_ADDR="node0", MASTER_PORT="29500", WORLD_SIZE="3", RANK=str(i),
                        TRAIN_LOCAL_ADDR=h.addr, TRAIN_SOCKET_IFNAME="eth0")
        nodes.append(start(net, h, "train", [sys.executable, ENTRY, "train", *SMALL,
                                             f"output.dir={tmp_path / 'runs'}"], env, tmp_path))
    nodes[0].wait_for(r"world size 3", 300)
    nodes[0].wait_for(r"checkpoint saved", 120)
    net.cut(hosts[2])
    cut = time.monotonic()
    for p in nodes[:2]:
        assert p.wait(timeout=120) == 1, p.text()[-3000:]
        last = p.text().strip().splitlines()[-1]
        assert last.startswith("error: training failed: lost node 2 (node2): no heartbeat "
                               "for "), last
    took = time.monotonic() - cut
    assert took < 120
    print(f"both survivors exited 1 naming node 2, {took:.1f} s after it vanished")


def test_the_stores_host_vanishing_costs_nothing_until_a_rendezvous_needs_it(net, tmp_path):
    store_host, _, _, nodes = elastic_job(net, tmp_path, 2, "1:2",
                                         "distributed.rdzv_store_wait_s=15")
    nodes[0].wait_for(r"world size 2", 300)
    nodes[0].wait_for(r"checkpoint saved", 120)
    net.cut(store_host)
    before = len(STEP.findall(nodes[0].text()))
    time.sleep(20)
    assert len(STEP.findall(nodes[0].text())) > before + 5, "training stopped with the store"
    assert "left the job" not in nodes[0].text()
    nodes[1].kill()  # now a re-rendezvous is needed, and the store is gone
    lost = time.monotonic()
    assert nodes[0].wait(timeout=300) == 5, nodes[0].text()[-3000:]
    last = nodes[0].text().strip().splitlines()[-1]
    assert last.startswith("error: the rendezvous store store:29400 did not come back "
                           "within 15 s"), last
    print(f"exit 5 {time.monotonic() - lost:.1f} s after the rendezvous became necessary")


# Node 1's rank pauses in its second checkpoint (step 20) after saying so, once, so that
# the test can partition the nodes while both are inside it; every step takes 0.1 s.
PAUSES_IN_CHECKPOINT = '''\
import os, time
from pathlib import Path
from torch import nn


class Slow(nn.Sequential):
    """0.1 s a forward pass: the run lasts long enough for the test to cut in."""
    def forward(self, x):
        time.sleep(0.1)
        return super().forward(x)


def build(inputs, outputs, in_checkpoint=True):
    model = Slow(nn.Linear(inputs, 32), nn.ReLU(), nn.Linear(32, outputs))
    calls = []

    def pause(module, state, prefix, local_metadata):
        calls.append(1)
        said = Path("in-checkpoint")
        if os.environ.get("RANK") == "1" and len(calls) == 2 and not said.exists():
            said.write_text(str(os.getpid()))
            time.sleep(8)

    if in_checkpoint:
        model._register_state_dict_hook(pause)
    return model
'''


@pytest.mark.parametrize("where", ["checkpoint", "step"])
def test_elastic_nodes_partitioned_name_the_wait_and_resume_when_healed(net, tmp_path, where):
    """In a checkpoint (node 1's rank pauses in the second one, step 20, for the test to
    cut in) or between two (after the first, step 10): the nodes still reach the store,
    and the hang watchdog would speak at 120 s at the earliest; every node's ranks waiting
    for the others in one phase is named within a minute (launcher/liveness/partition.py)
    with the default distributed.timeout_s (600 s), and once healed the job trains to its
    end from step 10."""
    (tmp_path / "pauser.py").write_text(PAUSES_IN_CHECKPOINT)
    config = write_config(tmp_path / "c.yaml", merge(TINY_MLP, {
        "model": {"kind": "custom", "factory": "pauser:build",
                  "args": {"inputs": 16, "outputs": 4, "in_checkpoint": where == "checkpoint"}},
        "train": {"max_steps": 40, "eval_every_steps": 0},
        "logging": {"every_steps": 1, "progress": "plain"},
        "checkpoint": {"every_steps": 10},
        "distributed": {"max_restarts": 3}}))
    _, _, hosts, nodes = elastic_job(net, tmp_path, 2, "1:2", config=config)
    nodes[0].wait_for(r"\| world size 2 \|", 300)
    if where == "checkpoint":
        deadline = time.monotonic() + limit(240)
        while not (tmp_path / "in-checkpoint").exists():
            assert time.monotonic() < deadline and nodes[1].running, nodes[1].text()[-3000:]
            time.sleep(0.1)
        phase = r"in the checkpoint of step 20"
    else:
        nodes[0].wait_for(r"checkpoint saved", 240)
        phase = r"in step \d+"
    net.partition(hosts[0], hosts[1])
    cut = time.monotonic()
    named = rf"lost contact between nodes: every node's ranks have waited {phase} for \d+ s " \
            r"while the rendezvous store still answers \(\S+ rank 0, \S+ rank 1\): a network " \
            r"partition between the nodes"
    # Each node's launcher says it (one may adopt the other's word); either is the name.
    deadline = time.monotonic() + limit(60)
    while not (said := [m.group(0) for node in nodes
                        if (m := re.search(named + r".*", node.text()))]):
        assert time.monotonic() < deadline, nodes[0].text()[-3000:]
        time.sleep(0.2)
    took = time.monotonic() - cut
    assert took < limit(60), f"the partition was named {took:.0f} s after the cut"
    # ... and its ranks end as the hang watchdog's hang does, with that line
    hung = rf"hang watchdog: {named}"
    deadline = time.monotonic() + limit(30)
    while not any(re.search(hung, node.text()) for node in nodes):
        assert time.monotonic() < deadline, nodes[0].text()[-3000:]
        time.sleep(0.2)
    net.unpartition(hosts[0], hosts[1])
    for node in nodes:
        assert node.wait(240) == 0, node.text()[-3000:]
    resumed = re.findall(r"resumed from \S+step-(\d+)", nodes[0].text())
    # the last sealed checkpoint: the one the partition interrupted never was
    assert resumed and resumed[0] in (("10",) if where == "checkpoint" else ("10", "20")), \
        nodes[0].text()[-3000:]
    result = (tmp_path / "runs").glob("*/result.json")
    assert [json.loads(r.read_text())["step"] for r in result] == [40]
    print(f"partitioned in a {where}: named {took:.1f} s after the cut: {said[0]}")
