"""Replica groups of several nodes (pods) each: the job's nodes split into the groups in
order (group = node // nodes per group), each node's launcher plans its part of its
group, and the group's nodes meet at a c10d rendezvous of that group alone: on SLURM
at the group's first node (the job's port + 1; node 0 holds the Lighthouse at the
job's port), on Kubernetes at the Job's standalone store, under an id of the group's.
Nodes that do not split into the groups are exit 2 naming both. Made-up allocations;
the cluster for real: tests/e2e/test_slurm_replicas.py.
"""

from __future__ import annotations

import pytest

from launcher.commands import doctor
from tests.unit import test_replica_k8s_plan as k8s
from tests.unit import test_replica_slurm_plan as slurm
from tests.unit.test_slurm_plan import step
from train.core.errors import UserError
from train.core.run.replica_contract import ADDR_VAR, GROUP_VAR, GROUPS_VAR, LIGHTHOUSE_VAR

prepare, JOB, PORT = slurm.prepare, slurm.JOB, slurm.PORT
config, torchft_here = slurm.config, slurm.torchft_here  # its fixtures
HOSTS = ["gpu07", "gpu08", "gpu09", "gpu10"]


def slurm_node(config, n: int, *overrides: str, nodes: int = 4, dry_run: bool = False):
    return prepare("train", config, "distributed.replicas=2", *overrides, dry_run=dry_run,
                   env=step(nodes, 1, procid=n, job=JOB, nodelist=f"gpu[07-{6 + nodes:02d}]"))


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_four_slurm_nodes_are_two_groups_of_two_meeting_at_their_first_node(
        config, torchft_here, n):
    p = slurm_node(config, n, "distributed.max_restarts=4")
    groups, group, first = p.plan.replica_groups, n // 2, HOSTS[n // 2 * 2]
    assert groups.here == (group,) and groups.groups == 2 and groups.per_group == 2
    assert groups.envs[0] == {GROUP_VAR: str(group), GROUPS_VAR: "2",
                              LIGHTHOUSE_VAR: f"http://gpu07:{PORT}", ADDR_VAR: HOSTS[n]}
    text = " ".join(groups.argvs[0])
    assert (f"--nnodes 2 --rdzv-backend c10d --rdzv-endpoint {first}:{PORT + 1} "
            f"--rdzv-id slurm-{JOB}.0-group{group} --rdzv-conf is_host="
            f"{'true' if n % 2 == 0 else 'false'},") in text
    assert f"--local-addr {HOSTS[n]} --role group{group}-rank" in text
    assert "--max-restarts 4" in text and "static" not in text and "127.0.0.1" not in text
    assert p.plan.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert p.plan.nnodes == (2, 2) and p.plan.heartbeat is None and not p.plan.static_nodes
    assert p.plan.world_sizes == (4,)  # the logical world: 2 replicas x 2 nodes x 1
    # the group's second node waits for its first's name to resolve; node 0 alone serves
    assert p.plan.rdzv_host == (first if n % 2 else None)
    assert groups.serve == (n == 0) and groups.at == f"gpu07:{PORT}"
    assert f"this node runs its part of replica group {group} of 2 (nodes " \
           f"{group * 2}..{group * 2 + 1}, 2 per group; this is the group's node {n % 2})" \
           in " ".join(p.plan.notes)


def test_dry_run_and_doctor_say_the_groups_nodes(config, torchft_here):
    text = slurm_node(config, 3, dry_run=True).plan.render()
    assert "# replica group 1 of 2 on this node (2 + 0 spare(s), 2 nodes each; this is " \
           "the group's node 1)" in text
    d = prepare("doctor", config, "distributed.replicas=2",
                env=step(4, 1, procid=2, job=JOB, nodelist="gpu[07-10]"))
    line = next(ln for ln in doctor._plan_lines(d.plan.to_dict())
                if ln.startswith("replicas "))
    assert f"2 nodes each, this node's: group 1; Lighthouse at gpu07:{PORT}" in line


@pytest.mark.parametrize("nodes, spares", [(3, 0), (5, 0), (4, 1)])
def test_nodes_that_do_not_split_into_the_groups_are_exit_2(config, torchft_here, nodes,
                                                            spares):
    p = slurm_node(config, 0, f"distributed.spares={spares}", nodes=nodes)
    assert isinstance(p, UserError) and p.exit_code == 2
    line = p.one_line()
    assert f"{2 + spares} replica groups of as many nodes each" in line
    assert f"the SLURM step has {nodes} node(s)" in line and "multiple" in line


@pytest.mark.parametrize("n", [1, 3])
def test_pods_of_a_group_meet_at_the_jobs_store_under_the_groups_id(config, torchft_here, n):
    p = k8s.prepare("train", config, "distributed.replicas=2", env=k8s.pod(n, nnodes="4"))
    groups = p.plan.replica_groups
    assert groups.here == (n // 2,) and groups.per_group == 2 and not groups.serve
    assert groups.envs[0][ADDR_VAR] == f"10.0.0.{7 + n}"
    text = " ".join(groups.argvs[0])
    assert ("--nnodes 2 --rdzv-backend c10d --rdzv-endpoint train-rendezvous:29400 "
            f"--rdzv-id 0b7c-uid-group{n // 2} --rdzv-conf is_host=false,") in text
    assert f"--local-addr 10.0.0.{7 + n} --role group{n // 2}-rank" in text
    assert p.plan.nnodes == (2, 2) and p.plan.world_sizes == (4,)
    assert p.plan.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert f"this pod runs its part of replica group {n // 2} of 2 (pods" in \
           " ".join(p.plan.notes)


def test_pods_that_do_not_split_into_the_groups_are_exit_2(config, torchft_here):
    p = k8s.prepare("train", config, "distributed.replicas=2", "distributed.spares=1",
                    env=k8s.pod(0, nnodes="4"))
    assert isinstance(p, UserError) and p.exit_code == 2
    assert "TRAIN_NNODES is 4 (the Job's pods)" in p.one_line()
