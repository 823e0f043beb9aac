"""The SLURM cluster of tests/harness/slurmcluster.py works: jobs land on two hosts with their
own hostnames, tasks are numbered as slurm numbers them, batch scripts run and write
their output, and scancel reaches a task as SIGTERM; the shipped templates, which ask
for GPUs, are refused by this cluster (it has no GPU GRES) and accepted with the option
docs/slurm.md gives for such a cluster. One cluster for the module; the tests of the
launcher under slurm build on what these show.
"""

from __future__ import annotations

import os

import pytest

from tests.harness.runs import NO_GPU, ROOT, clean_env
from tests.harness.slurmcluster import SlurmCluster, wait_for_text

TEMPLATES = ("train.sbatch", "train-pyxis.sbatch", "train-apptainer.sbatch")
NO_GPUS = "--gpus-per-node=0"  # docs/slurm.md: the templates on a cluster without GPU GRES


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


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_template_is_refused_as_shipped_and_accepted_asking_for_no_gpus(cluster, template):
    """sbatch's command line and SBATCH_GPUS_PER_NODE override the template's
    `#SBATCH --gpus-per-node=8`; `--gres=none` does not. Held, so it never runs (the
    container templates need pyxis or Apptainer); 1 CPU per task, as this cluster has 2."""
    script = ROOT / "slurm" / template
    assert f"sbatch {NO_GPUS} slurm/{template} " in script.read_text()  # its header says how
    cmd = ["sbatch", "--parsable", "--hold", "--cpus-per-task=1", str(script)]
    for refused in ([], ["--gres=none"]):
        out = cluster.run(cmd[:-1] + refused + cmd[-1:])
        assert out.returncode == 1, out.stdout
        assert "Invalid generic resource (gres) specification" in out.stderr
    for option, env in (([NO_GPUS], {}), ([], {"SBATCH_GPUS_PER_NODE": "0"})):
        job = cluster.sbatch(script, "--hold", "--cpus-per-task=1", *option, env=env)
        fields = cluster.job(job)
        cluster.scancel(job)
        assert (fields["JobState"], fields["Reason"]) == ("PENDING", "JobHeldUser"), fields
        assert fields["TresPerNode"] == "gres:gpu:0"


def test_the_template_runs_on_cpu_nodes_with_the_documented_command(cluster):
    """`sbatch --gpus-per-node=0 slurm/train.sbatch CONFIG device=cpu` (docs/slurm.md),
    planned with --dry-run by the launcher on both nodes."""
    out = cluster.work / "cpu-nodes.out"
    env = {**clean_env(), **NO_GPU, "REPO": str(ROOT), "RUNS": str(cluster.work / "runs")}
    job = cluster.sbatch(ROOT / "slurm" / "train.sbatch", NO_GPUS, "--cpus-per-task=1",
                         f"--output={out}", env=env,
                         script_args=(str(ROOT / "configs" / "gpt-small.yaml"), "device=cpu",
                                      "--dry-run"))
    assert cluster.wait_job(job, 120) == "COMPLETED", out.read_text()[-3000:]
    text = wait_for_text(out, "this is node 1", 30)
    assert text.count("mode=torchrun device=cpu backend=gloo nproc_per_node=1 nnodes=2:2") == 2
    assert "this is node 0 (node1)" in text and "this is node 1 (node2)" in text
