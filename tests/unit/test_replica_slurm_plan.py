"""Replica groups on SLURM (one task per node): each node's launcher plans ITS group
alone (group id = SLURM_NODEID, NUM_REPLICA_GROUPS = the step's nodes) under a torchrun
of its own node; node 0 also starts the Lighthouse, at the first node's address and the
job's port; a node count other than replicas + spares is exit 2 naming both. Made-up
allocations (tests/unit/test_slurm_plan.py's); the cluster for real:
tests/e2e/test_slurm_replicas.py.
"""

from __future__ import annotations

import pytest

from launcher.conventions import slurm
from launcher.running import lighthouse
from tests.unit import test_replica_plan as one_machine
from tests.unit.test_slurm_plan import step
from train.core.errors import UserError
from train.core.run.replica_contract import ADDR_VAR, GROUP_VAR, GROUPS_VAR, LIGHTHOUSE_VAR

LIGHTHOUSE, prepare = one_machine.LIGHTHOUSE, one_machine.prepare
config, torchft_here = one_machine.config, one_machine.torchft_here  # its fixtures
JOB = "4242"
PORT = slurm.PORT_BASE + 2 * (int(JOB) % slurm.PORT_SPAN)  # the job's port, as every node's


def node(config, n: int, nodes: int = 3, *overrides: str, **extra: str):
    return prepare("train", config, "distributed.replicas=2", "distributed.spares=1",
                   *overrides, env=step(nodes, 1, procid=n, job=JOB,
                                        nodelist="gpu[07-09]" if nodes == 3 else "gpu[07-08]",
                                        **extra))


@pytest.mark.parametrize("n", [0, 1, 2])
def test_each_node_runs_its_own_group_under_a_torchrun_of_its_own(config, torchft_here, n):
    p = node(config, n, 3, "distributed.max_restarts=4")
    groups = p.plan.replica_groups
    assert groups.here == (n,) and groups.groups == 3 and len(groups.argvs) == 1
    assert groups.envs[0] == {GROUP_VAR: str(n), GROUPS_VAR: "3",
                              LIGHTHOUSE_VAR: f"http://gpu07:{PORT}", ADDR_VAR: f"gpu0{7 + n}"}
    text = " ".join(groups.argvs[0])
    # the node's own rendezvous on 127.0.0.1, its own restarts; no static rendezvous
    assert "--rdzv-endpoint 127.0.0.1:${RDZV_PORT} --rdzv-id replica-group-" \
           f"{n} --nnodes 1 --local-addr 127.0.0.1" in text
    assert "--max-restarts 4" in text and "static" not in text
    assert p.plan.nnodes == (1, 1) and p.plan.heartbeat is None and not p.plan.static_nodes
    assert p.plan.world_sizes == (2,)  # the logical world: 2 replicas x 1 process
    # only node 0 starts the Lighthouse, bound to the first node's address
    assert groups.serve == (n == 0) and groups.at == f"gpu07:{PORT}"
    assert groups.lighthouse[:3] == (LIGHTHOUSE, "--bind", f"gpu07:{PORT}")
    assert p.plan.job == f"slurm-{JOB}.0"  # one lease for every node of the step
    assert f"this node runs replica group {n} of 3, the Lighthouse at gpu07:{PORT}" in \
        " ".join(p.plan.notes)


def test_dry_run_says_which_group_and_whose_lighthouse(config, torchft_here):
    first = prepare("train", config, env=step(2, 1, procid=0, job=JOB), dry_run=True)
    text = first.plan.render()
    assert "# replica group 0 of 2 on this node (2 + 0 spare(s), one per node)" in text
    assert f"# Lighthouse at http://gpu07:{PORT}: started here" in text
    assert f"{LIGHTHOUSE} --bind gpu07:{PORT}" in text
    other = prepare("train", config, env=step(2, 1, procid=1, job=JOB), dry_run=True)
    text = other.plan.render()
    assert "node 0's, waited for" in text and "--bind" not in text
    assert "REPLICA_GROUP_ID=1 \\" in text


def test_master_port_is_the_lighthouse_port(config, torchft_here):
    p = node(config, 1, 3, MASTER_PORT="31000")
    assert p.plan.replica_groups.at == "gpu07:31000"


@pytest.mark.parametrize("nodes", [2, 4])
def test_nodes_other_than_the_groups_are_exit_2_naming_both(config, torchft_here, nodes):
    p = prepare("train", config, "distributed.replicas=2", "distributed.spares=1",
                env=step(nodes, 1, procid=0, job=JOB, nodelist=f"n[1-{nodes}]"))
    assert isinstance(p, UserError) and p.exit_code == 2
    line = p.one_line()
    assert "distributed.replicas" in line and "2 replica(s) + 1 spare(s)" in line
    assert f"the SLURM step has {nodes} node(s)" in line and "\n" not in line


def test_one_task_per_gpu_is_exit_3(config, torchft_here):
    p = prepare("train", config, env=step(2, 2, procid=0, job=JOB))
    assert isinstance(p, UserError) and p.exit_code == 3
    assert "one task per node" in p.one_line()


def test_a_taken_lighthouse_port_is_exit_3_naming_it(config, torchft_here):
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = node(config, 0, 2, "distributed.spares=0", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port))
        got = lighthouse.start(p.plan, (), lambda line: None)
    assert got.code == 3 and f"127.0.0.1:{port}" in got.message


def test_another_nodes_lighthouse_is_lost_after_refusals_in_a_row(monkeypatch):
    answers = iter([True, False, False, True, False, False, False])
    monkeypatch.setattr(lighthouse, "reachable", lambda endpoint: next(answers))
    monkeypatch.setattr(lighthouse, "CHECK_S", 0.0)
    far = lighthouse.Lighthouse(None, PORT, "gpu07")
    seen = [far.gone() for _ in range(7)]
    assert seen[:6] == [None] * 6 and seen[6] == "stopped accepting connections"
    assert far.named() == f"the Lighthouse (node 0's, http://gpu07:{PORT})"


def test_node_0_reads_how_many_groups_its_lighthouse_hears_from():
    """The Lighthouse's status page, as torchft 0.2 writes it; 0 when it does not answer."""
    import http.server
    import threading

    class Status(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"Next quorum status: New quorum not ready [0/0 participants "
                             b"healthy][2 heartbeating][shrink_only=false]")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert lighthouse.Lighthouse(None, server.server_port).beating() == 2
    finally:
        server.shutdown()
        server.server_close()
    assert lighthouse.Lighthouse(None, server.server_port).beating() == 0


def test_doctor_shows_this_nodes_group_and_whose_lighthouse(config, torchft_here):
    from launcher.commands import doctor
    for n, whose in ((0, "started here"), (1, "node 0's")):
        d = prepare("doctor", config, env=step(2, 1, procid=n, job=JOB))
        lines = doctor._plan_lines(d.plan.to_dict())
        line = next(ln for ln in lines if ln.startswith("replicas "))
        assert f"this node's: group {n}; Lighthouse at gpu07:{PORT}, {whose}" in line
        assert any(ln.startswith(f"group {n}    replica: REPLICA_GROUP_ID={n}") for ln in lines)
