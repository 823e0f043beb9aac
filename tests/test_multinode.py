"""Multi-node runs never hang silently. Simulated nodes (tests/multinode.py: the real
entrypoint, each node in its own PID namespace where the kernel allows, all on
127.0.0.1): the static convention's bounded exit and resume, colliding identities, a
rendezvous store that does not come back, one log line per round. Node loss and
rejoin, scale-up and a store lost and back, under the Indexed Job convention, are the
story of tests/test_k8s_sim.py (the same harness, driven by the k8s/ manifests)."""

from __future__ import annotations

import datetime
import json
import re
import signal
import socket
import sys

import pytest

from launcher.rdzv_state import Round, describe
from launcher.rendezvous import RoundWatcher
from tests.harness.multinode import SMALL_JOB, Cluster, Process, first, pid_namespaces
from tests.harness.runs import ENTRY, clean_env


# A constant schedule: a reference run stopped at any step saw the same learning rates.
def stop_all(nodes: list[Process]) -> list[int]:
    for node in nodes:
        node.signal(signal.SIGTERM)
    return [node.wait(90) for node in nodes]


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, clean_env(), nnodes="1:2")
    yield c
    c.close()


@pytest.mark.slow
def test_static_rendezvous_loses_a_node_exits_promptly_and_resumes_after_restart(tmp_path):
    """Kubeflow PyTorchJob v1: a lost pod ends every pod (never a silent hang); the
    restarted pods resume from the last checkpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [*SMALL_JOB, f"output.dir={tmp_path / 'runs'}"]
    namespaces = pid_namespaces()

    def pod(rank: int) -> Process:
        env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                        RANK=str(rank))
        return Process(f"pod{rank}", [sys.executable, ENTRY, "train", *args], env, tmp_path,
                       cpus={rank % 2}, namespace=namespaces)

    pods = [pod(0).start(), pod(1).start()]
    try:
        first(pods, r"checkpoint saved: .*step-20")
        pods[1].kill()
        assert pods[0].wait(120) == 1
        last = pods[0].text().strip().splitlines()[-1]
        assert "lost the connection to the worker at 127.0.0.1:" in last
        assert "restart the job (its pods, or resubmit it) and it resumes from the last " \
               "checkpoint" in last
        pods = [p.start() for p in pods]  # the restart policy
        first(pods, r"resumed from .*step-\d+ at step \d+(.|\n)*\]:step \d+/")
        assert stop_all(pods) == [143, 143]
    finally:
        for p in pods:
            if p.running:
                p.kill()


@pytest.mark.slow
def test_nodes_with_the_same_address_and_pid_stay_two_nodes(cluster, tmp_path):
    """In PID namespaces both torchruns have the same pid and address: without a unique
    identity they merged into one participant and hung."""
    if not cluster.namespaces:
        pytest.skip("needs PID namespaces (unshare) to give two nodes the same pid")
    args = [*SMALL_JOB, f"output.dir={tmp_path / 'runs'}", "train.max_steps=40"]
    cluster.nnodes = "2"
    cluster.start_store()
    nodes = [cluster.node(i, args).start() for i in range(2)]
    assert [n.wait(240) for n in nodes] == [0, 0]
    first(nodes, r"world size 2")
    store_log = cluster.store.text()
    assert re.search(r"round 0 complete: 2 node\(s\)", store_log)
    assert "stand(s) for several nodes" in store_log  # named, not merged


@pytest.mark.slow
def test_a_store_that_does_not_come_back_ends_the_node_with_exit_5(cluster, tmp_path):
    args = [*SMALL_JOB, f"output.dir={tmp_path / 'runs'}", "distributed.rdzv_store_wait_s=3"]
    cluster.nnodes = "1"
    cluster.start_store()
    node = cluster.node(0, args).start()
    node.wait_for(r"\]:step 5/", 180)
    cluster.store.kill()
    assert node.wait(120) == 5
    last = node.text().strip().splitlines()[-1]
    assert last.startswith("error: the rendezvous store 127.0.0.1:") and "within 3 s" in last
    assert (tmp_path / "runs" / "quickstart" / "checkpoints" / "latest").exists()


# --------------------------------------------------------------- one line a round

def _round(number: int, complete: bool, members: dict[str, int], **kw) -> Round:
    return Round(number=number, complete=complete, closed=False, deadline=kw.get("deadline"),
                 members=members, waiting=kw.get("waiting", ()), silent=kw.get("silent", {}))


def test_a_node_logs_each_round_who_left_and_joined_and_long_waits():
    lines: list[str] = []
    w = RoundWatcher("127.0.0.1:1", "job", (2, 3), 600, lines.append, still_every_s=15)
    w.observe(_round(0, True, {"a:1": 0, "b:1": 1}), now=0)
    w.observe(_round(0, True, {"a:1": 0, "b:1": 1}, silent={"b:1": 6.0}), now=1)
    w.observe(_round(1, False, {"a:1": 0}), now=2)
    w.observe(_round(1, False, {"a:1": 0}), now=10)  # nothing new yet: no line
    w.observe(_round(1, False, {"a:1": 0}), now=18)  # still waiting after 16 s
    w.observe(_round(1, True, {"a:1": 0, "c:1": 1}), now=20)
    assert lines[0] == "rendezvous round 0 complete: 2 node(s) [a:1 rank 0, b:1 rank 1]"
    assert lines[1] == ("rendezvous round 0 complete: 2 node(s) [a:1 rank 0, b:1 rank 1 "
                        "(silent 6 s)]")
    assert lines[2] == "rendezvous round 1 forming: 1 node(s) [a:1]"
    assert lines[3].startswith("rendezvous: still waiting in round 1: 1 node(s) joined, at "
                               "least 2 needed, for 16 s")
    assert lines[4] == ("rendezvous round 1 complete: 2 node(s) [a:1 rank 0, c:1 rank 1]; "
                        "joined: c:1; left: b:1")
    assert len(lines) == 5


def test_a_node_left_out_of_a_newer_round_stops_its_stale_workers_once():
    """Cut off and healed: the others met without this node ("c:7#42"); its workers are
    in a world that no longer exists. A node that only waits to join is not told so."""
    left_out: list[int] = []
    w = RoundWatcher("127.0.0.1:1", "job", (1, 3), 600, lambda line: None, me=":7#42",
                     on_left_out=left_out.append)
    w.observe(_round(0, True, {"a:1#5": 0, "c:7#42": 1}), now=0)
    w.observe(_round(1, True, {"a:1#5": 0, "c:7#42": 1}), now=1)  # still a member
    assert left_out == []
    w.observe(_round(3, True, {"a:1#5": 0}), now=2)  # rounds went on without it
    w.observe(_round(3, True, {"a:1#5": 0}), now=3)
    w.observe(_round(4, False, {"a:1#5": 0, "c:7#42": 0}), now=4)
    w.observe(_round(4, True, {"a:1#5": 0, "c:7#42": 1}), now=5)
    assert left_out == [3]
    joiner: list[int] = []
    new = RoundWatcher("127.0.0.1:1", "job", (1, 3), 600, lambda line: None, me=":9#43",
                       on_left_out=joiner.append)
    new.observe(_round(5, True, {"a:1#5": 0, "c:7#42": 1}), now=0)
    new.observe(_round(6, True, {"a:1#5": 0}), now=1)
    assert joiner == []


def test_silence_that_includes_this_node_is_no_lost_node():
    """Every member's keep-alive late, this node's too (a store that was slow to answer,
    a loaded machine): nobody vanished. A member dropped from the round still is lost."""
    lost: list[list[str]] = []
    w = RoundWatcher("127.0.0.1:1", "job", (1, 3), 600, lambda line: None, lost_after_s=10,
                     on_lost=lambda nodes, why: lost.append(nodes), me=":7#42")
    w.observe(_round(0, True, {"a:1#5": 0, "c:7#42": 1}), now=0)
    w.observe(_round(0, True, {"a:1#5": 0, "c:7#42": 1},
                     silent={"a:1#5": 13.0, "c:7#42": 13.0}), now=1)
    assert lost == []
    w.observe(_round(0, True, {"c:7#42": 1}, silent={"c:7#42": 13.0}), now=2)
    assert lost == [["a:1#5"]]
    alone: list[list[str]] = []
    other = RoundWatcher("127.0.0.1:1", "job", (1, 3), 600, lambda line: None,
                         lost_after_s=10, on_lost=lambda nodes, why: alone.append(nodes),
                         me=":7#42")
    other.observe(_round(0, True, {"a:1#5": 0, "c:7#42": 1}), now=0)
    other.observe(_round(0, True, {"a:1#5": 0, "c:7#42": 1}, silent={"a:1#5": 11.0}), now=1)
    assert alone == [["a:1#5"]]


def test_a_forming_round_says_until_when_and_shows_no_ranks():
    deadline = datetime.datetime(2026, 1, 1, 12, 0, 3, tzinfo=datetime.UTC)
    text = describe(_round(4, False, {"b:2#9": 0, "b:2#7": 0}, deadline=deadline))
    assert text.startswith("round 4 forming: 2 node(s) [b:2#7, b:2#9]; last call until ")
    assert "rank" not in text.split(";")[0]
    assert "b:2 stand(s) for several nodes" in text


def test_rendezvous_timings_are_config_keys(tmp_path):
    import yaml

    from launcher import environ
    from launcher.hardware import Hardware, TorchBuild
    from launcher.plan import plan
    from train.core.config import load_config
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"kind": "mlp"}, "data": {"kind": "synthetic"},
                                    "output": {"dir": str(tmp_path)}}))
    cfg = load_config(path, ["distributed.rdzv_last_call_s=1", "distributed.rdzv_keep_alive_s=5",
                             "distributed.rdzv_join_timeout_s=60"])
    env = environ.read({"JOB_COMPLETION_INDEX": "0", "TRAIN_RDZV_ENDPOINT": "s:1",
                        "TRAIN_NNODES": "1:2", "TRAIN_RDZV_ID": "u"})
    p = plan(cfg, Hardware(cpus=4), TorchBuild(version="x", gloo=True), env,
             config_path=str(path), overrides=[], python="py", app_root="/app")
    conf = p.argv[p.argv.index("--rdzv-conf") + 1]
    assert conf == ("is_host=false,join_timeout=60,last_call_timeout=1,keep_alive_interval=5,"
                    "keep_alive_max_attempt=3")
    assert p.store == "s:1" and p.job == "u" and p.join_timeout_s == 60
    assert json.loads(json.dumps(p.to_dict()))["store_wait_s"] == 300


@pytest.mark.slow
def test_a_node_leaving_on_purpose_costs_the_others_no_restart(cluster):
    """Scale-down or a one-node drain: SIGTERM to one node. It checkpoints and exits 143
    with every rank; the other node trains on at the smaller world size. With
    distributed.max_restarts=0 it could not if the departure counted as its failure."""
    cluster.start_store()
    nodes = [cluster.node(i, [*SMALL_JOB, "distributed.max_restarts=0"]).start() for i in range(2)]
    main = first(nodes, r"world size 2(.|\n)*\]:step 25/")
    leaving = nodes[1] if main is nodes[0] else nodes[0]
    leaving.signal(signal.SIGTERM)
    assert leaving.wait(120) == 143, leaving.text()[-3000:]
    main.wait_for(r"another node left the job; meeting the others again \(no restart "
                  r"counted\)", 120)
    main.wait_for(r"resumed from .*now 1\)(.|\n)*\]:step \d+/", 180)
    assert main.running
    assert stop_all([main]) == [143]
