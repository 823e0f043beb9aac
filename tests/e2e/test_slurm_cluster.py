"""The SLURM cluster of tests/harness/slurmcluster.py works: jobs land on two hosts with their
own hostnames, tasks are numbered as slurm numbers them, batch scripts run and write
their output, and scancel reaches a task as SIGTERM. One cluster for the module; the
tests of the launcher under slurm build on what these show.
"""

from __future__ import annotations

import os

import pytest

from tests.harness.slurmcluster import SlurmCluster, wait_for_text


@pytest.fixture(scope="module")
def cluster(slurm_cluster):
    return slurm_cluster


def srun(cluster: SlurmCluster, *argv: str) -> list[str]:
    out = cluster.run(["srun", *argv], timeout=120)
    assert out.returncode == 0, f"srun {' '.join(argv)}: {out.stderr}\n{cluster.logs()}"
    return out.stdout.split()


def test_srun_lands_on_two_hosts_with_their_own_hostnames(cluster):
    names = srun(cluster, "-N2", "--ntasks-per-node=1", "hostname")
    assert sorted(names) == ["node1", "node2"]
    assert os.uname().nodename not in names


def test_tasks_are_numbered_across_both_nodes(cluster):
    ranks = srun(cluster, "-N2", "--ntasks-per-node=2", "printenv", "SLURM_PROCID")
    assert sorted(int(r) for r in ranks) == [0, 1, 2, 3]


def test_a_batch_script_runs_and_writes_its_output(cluster):
    out = cluster.work / "batch.out"
    script = cluster.work / "batch.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH -N2 --ntasks-per-node=1 -o {out}\n"
                      'echo "batch on $(hostname) job $SLURM_JOB_ID"\nsrun hostname\n')
    job = cluster.sbatch(script)
    assert cluster.wait_job(job, 120) == "COMPLETED", cluster.job(job)
    text = wait_for_text(out, "node2", 30)
    assert f"batch on node1 job {job}" in text
    assert sorted(text.split()[-2:]) == ["node1", "node2"]


def test_scancel_delivers_sigterm_to_the_task(cluster):
    out, caught = cluster.work / "trap.out", cluster.work / "trap.caught"
    script = cluster.work / "trap.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH -o {out}\n"
                      f"trap 'echo TERM > {caught}; exit 0' TERM\n"
                      "echo started\nsleep 600 &\nwait\n")
    job = cluster.sbatch(script)
    wait_for_text(out, "started", 120)
    cluster.scancel(job)
    assert cluster.wait_job(job, 120) == "CANCELLED"
    assert wait_for_text(caught, "TERM", 60)
