"""The preflight check's links (train/core/nodes/link_rule.py, train/guards/links.py): which node
pairs are timed, which node is named, and, for real, three hosts in network namespaces
(tests/harness/netns.py) exchanging over gloo: silent while every link is alike, then
the host whose interface tc holds back (a netem delay; a token-bucket rate where the
kernel has no netem) is named, and only that one. The whole
preflight in a real multi-node start: tests/e2e/test_preflight_runs.py."""

from __future__ import annotations

import json
import re
import sys
import textwrap
import time

import pytest

from tests.harness.runs import ROOT, limit, worker_env
from train.core.nodes import link_rule
from train.core.nodes.verdict import RankResult, judge

MIB = 1 << 20


def test_every_node_meets_a_different_peer_each_round_and_at_most_three():
    for nodes in range(2, 12):
        rounds = link_rule.schedule(nodes)
        assert len(rounds) == min(3, nodes - 1 + nodes % 2)
        met = set()
        for pairs in rounds:
            assert all(pairs[peer] == node for node, peer in pairs.items())  # both ways
            assert len(pairs) == nodes - nodes % 2  # one sits out when the count is odd
            met |= {frozenset(p) for p in pairs.items()}
        assert len(met) == sum(len(p) for p in rounds) // 2  # no pair meets twice
    assert link_rule.schedule(1) == []
    assert [len(p) for p in link_rule.schedule(3)] == [2, 2, 2]  # three nodes: every pair


def test_ranks_pair_with_the_same_local_rank_on_the_peer_node():
    layout = {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3, (2, 0): 4}
    assert link_rule.partner(0, 1, 1, layout) == 3
    assert link_rule.partner(0, 1, 2, layout) is None  # node 2 has one rank only


def ranks(times_ms: dict[tuple[int, int], float], nodes: int) -> list[RankResult]:
    """One rank per node; each pair's time as both sides measured it."""
    return [RankResult(rank=n, node=n, host=f"host-{'abcdefgh'[n]}", link_bytes=MIB,
                       links=tuple((b if a == n else a, ms) for (a, b), ms in times_ms.items()
                                   if n in (a, b)))
            for n in range(nodes)]


def test_the_node_whose_every_link_is_slow_is_named_with_its_speed():
    times = {(0, 1): 2.0, (0, 2): 50.0, (1, 2): 52.0, (0, 3): 2.2, (1, 3): 2.1, (2, 3): 51.0}
    verdict = judge(ranks(times, 4), 0.5)
    assert verdict.slow == ["preflight: node 2 (host-c) links 0.04x the other nodes' "
                            "(21 vs 524 MB/s each way, its fastest of 3 peer nodes)"]
    assert verdict.hosts == ["host-c"] and verdict.summary is None


def test_a_pair_is_judged_by_its_faster_side_and_alike_links_name_no_one():
    # node 0 timed its exchange with node 2 late (it waited for node 2 to arrive)
    results = ranks({(0, 1): 2.0, (1, 2): 2.4}, 3)
    results[0] = RankResult(rank=0, node=0, host="host-a", link_bytes=MIB,
                            links=((1, 2.0), (2, 40.0)))
    results[2] = RankResult(rank=2, node=2, host="host-c", link_bytes=MIB,
                            links=((0, 2.1), (1, 2.4)))
    verdict = judge(results, 0.5)
    assert verdict.ok
    assert verdict.summary.endswith("links 1 MiB 437-524 MB/s")


def test_two_nodes_name_no_one_and_sub_millisecond_jitter_neither():
    assert judge(ranks({(0, 1): 90.0}, 2), 0.5).ok  # which end is slow? nothing says
    jitter = {(0, 1): 0.2, (0, 2): 0.9, (1, 2): 0.9}  # node 2: 4.5x, but 0.7 ms
    assert judge(ranks(jitter, 3), 0.5).ok


SCRIPT = textwrap.dedent("""\
    import datetime, json, socket, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from train.core.nodes.verdict import RankResult, judge
    from train.guards import links
    rank, work = int(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo", init_method="tcp://node0:29400", rank=rank,
                            world_size=3, timeout=datetime.timedelta(seconds=300))
    layout = [RankResult(rank=r, node=r) for r in range(3)]
    me = RankResult(rank=rank, node=rank, host=socket.gethostname())
    cpu, parts = torch.device("cpu"), []
    # alike links: measured again (at most 3 times) while a node is named, since the
    # other work of a loaded machine can hold one host back for a whole measurement
    for phase, attempts in (("alike", 3), ("delayed", 1)):
        while not (work / phase).exists():
            time.sleep(0.05)
        rounds = []
        for _ in range(attempts):
            before = len(parts)
            got = links.measure(layout, me, cpu, lambda: parts.append(1))
            mine = RankResult(rank=rank, node=rank, host=me.host, links=got,
                              link_bytes=links.nbytes(cpu))
            everyone = [None] * 3
            dist.all_gather_object(everyone, mine)
            verdict = judge(everyone, 0.5)
            rounds.append(verdict.lines)
            if verdict.ok:  # every rank judges the same gathered results
                break
        if rank == 0:
            (work / f"{phase}.json").write_text(json.dumps(
                {"rounds": rounds, "links": [r.links for r in everyone],
                 "parts": len(parts) - before}))
    dist.barrier()
    dist.destroy_process_group()
    """)


def _wait(path, procs, timeout: float) -> dict:
    deadline = time.monotonic() + limit(timeout)
    while not path.exists():
        for p in procs:
            assert p.running or p.proc.returncode == 0, p.text()[-3000:]
        assert time.monotonic() < deadline, [p.text()[-2000:] for p in procs]
        time.sleep(0.1)
    time.sleep(0.1)  # written by one write_text: let it finish
    return json.loads(path.read_text())


def test_three_hosts_alike_then_one_whose_link_tc_holds_back_is_named(net, tmp_path):
    hosts = [net.host(f"node{i}") for i in range(3)]
    # node2's kernel buffers a whole 1 MiB send at once: its side of an exchange is then
    # fast to it (a buffered send, a fast receive) however slowly its data leaves
    net.sysctl(hosts[2], "net.ipv4.tcp_wmem=4096 4194304 16777216")
    env = worker_env({"PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "eth0"})
    procs = [h.process("links", [sys.executable, "-c", SCRIPT, str(i), str(tmp_path)], env,
                       tmp_path).start() for i, h in enumerate(hosts)]
    net.procs.extend(procs)
    (tmp_path / "alike").touch()
    alike = _wait(tmp_path / "alike.json", procs, 120)
    qdisc = net.slow_link(hosts[2])  # node2's side of its every link
    try:
        (tmp_path / "delayed").touch()
        delayed = _wait(tmp_path / "delayed.json", procs, 120)
    finally:
        net.fast_link(hosts[2])
    for p in procs:
        assert p.wait(limit(60)) == 0, p.text()[-3000:]
    print("alike:", alike["rounds"], f"\nnode2 behind {qdisc}:", delayed["rounds"])
    last = alike["rounds"][-1]  # the first round that named no one, of at most 3
    assert len(last) == 1 and last[0].startswith("preflight: 3 ranks"), alike["rounds"]
    assert "links 1 MiB" in last[0]
    [[line]] = delayed["rounds"]
    assert line.startswith("preflight: node 2 (node2) links 0.") and \
        "its fastest of 2 peer nodes" in line, line
    # 50 mbit is 6.25 MB/s: no exchange of node2's can be timed faster than that (a load
    # only slows it); a send timed as done when merely buffered read 124 MB/s here
    slow = re.search(r"\((\d+(?:\.\d+)?) (?:MB/s )?vs ", line)
    assert slow and float(slow.group(1)) <= 2 * 6.25, line
    assert [len(r) for r in delayed["links"]] == [2, 2, 2]  # every pair of three, timed
    assert delayed["parts"] == 2 * 4  # two peers, a warm-up and 3 timed


@pytest.mark.parametrize("nodes", [3, 4])
def test_the_verdict_names_node_by_node_not_rank_by_rank(nodes):
    times = {(a, b): (40.0 if 1 in (a, b) else 2.0)
             for a in range(nodes) for b in range(a + 1, nodes)}
    results = [RankResult(rank=2 * n + lr, node=n, local_rank=lr, host=f"h{n}",
                          link_bytes=MIB,
                          links=tuple((b if a == n else a, ms) for (a, b), ms in times.items()
                                      if n in (a, b)))
               for n in range(nodes) for lr in range(2)]
    assert [line.split(" links")[0] for line in judge(results, 0.5).slow] == \
        ["preflight: node 1 (h1)"]
