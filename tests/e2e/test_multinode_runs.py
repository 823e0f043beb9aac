"""Multi-node runs never hang silently. Simulated nodes (tests/harness/multinode.py: the
real entrypoint, each node in its own PID namespace where the kernel allows, all on
127.0.0.1): the static convention's bounded exit and resume, colliding identities, a
rendezvous store that does not come back or that starts after the node, a node leaving
on purpose. Node loss and rejoin, scale-up and a store lost and back, under the Indexed
Job convention, are the story of tests/e2e/test_k8s_sim_runs.py (the same harness,
driven by the k8s/ manifests).
What a node says of each rendezvous round: tests/unit/test_multinode.py."""

from __future__ import annotations

import re
import signal
import sys
import time

import pytest

from launcher.detection.system import free_port
from tests.harness.multinode import SMALL_JOB, Cluster, Process, first, pid_namespaces
from tests.harness.runs import ENTRY, clean_env


def stop_all(nodes: list[Process]) -> list[int]:
    for node in nodes:
        node.signal(signal.SIGTERM)
    return [node.wait(90) for node in nodes]


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, clean_env(), nnodes="1:2")
    yield c
    c.close()


def test_static_rendezvous_loses_a_node_exits_promptly_and_resumes_after_restart(tmp_path):
    """Kubeflow PyTorchJob v1: a lost pod ends every pod (never a silent hang); the
    restarted pods resume from the last checkpoint."""
    port = free_port()
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


def test_a_store_that_starts_after_the_node_is_waited_for_not_lost(cluster, tmp_path):
    """The store's pod scheduled late, or its node's torchrun slow to start on a busy
    machine: a store that never answered yet is not a lost store (exit 5 would end a
    job that was only starting). The node trains once it is there."""
    cluster.port = free_port()
    cluster.nnodes = "1"
    node = cluster.node(0, [*SMALL_JOB, f"output.dir={tmp_path / 'runs'}",
                            "train.max_steps=6"]).start()
    node.wait_for(r"entrypoint: run ", 180)
    time.sleep(12)  # past the 8 s after which a store that answered, then went, is lost
    cluster.start_store(cluster.port)
    assert node.wait(300) == 0, node.text()[-3000:]
    assert "has not answered" not in node.text()


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
