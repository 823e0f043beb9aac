"""On a real SLURM cluster of three nodes (tests/harness/slurmcluster.py): a node the
preflight check finds unfit (``distributed.preflight: fail``: its matmul gives NaN) ends
the job's first incarnation with exit 3 before step 1, and task 0 requeues the job
without it (``scontrol requeuehold``, ``ExcNodeList``, ``release``); the next incarnation
runs on the two healthy nodes and trains to its end.

The fault follows the host, as a bad GPU would: the test's model factory replaces
``torch.mm`` in the worker on ``node2`` only (the model's own layers do not call it)."""

from __future__ import annotations

import sys

import pytest

from tests.harness.runs import ENTRY, NO_GPU, TINY_MLP, clean_env, merge, write_config
from tests.harness.slurmcluster import wait_for_text

BAD_HOST = "node2"
FAULTY = f'''
import os
import socket

import torch


def build(inputs, outputs, width):
    if socket.gethostname() == "{BAD_HOST}" and "TORCHELASTIC_RUN_ID" in os.environ:
        real = torch.mm
        torch.mm = lambda a, b: real(a, b).fill_(float("nan"))  # a GPU computing garbage
    return torch.nn.Sequential(torch.nn.Linear(inputs, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, outputs))
'''


@pytest.fixture(scope="module")
def cluster(slurm_cluster3):
    return slurm_cluster3


def test_a_node_failing_the_preflight_check_is_left_out_of_the_requeued_job(cluster):
    work = cluster.work
    (work / "faultymm.py").write_text(FAULTY)
    cfg = write_config(work / "unfit.yaml", merge(TINY_MLP, {
        "run": {"name": "unfit"}, "output": {"dir": str(work / "runs")},
        "model": {"kind": "custom", "factory": "faultymm:build",
                  "args": {"inputs": 16, "outputs": 4, "width": 32}},
        "train": {"max_steps": 6, "eval_every_steps": 0},
        "distributed": {"preflight": "fail"}}))
    script = work / "unfit.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH -N2\n#SBATCH --ntasks-per-node=1\n"
                      "#SBATCH --requeue\n#SBATCH -o unfit.out\n#SBATCH --open-mode=append\n"
                      f"srun {sys.executable} {ENTRY} train {cfg}\n")
    env = {**clean_env(), **NO_GPU, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    job = cluster.sbatch(script, env=env)
    out = work / "unfit.out"
    text = wait_for_text(out, "requeued the job without", 300)
    assert f"preflight: node 1 ({BAD_HOST}) matmul gave NaN" in text, text[-3000:]
    assert f"requeued the job without {BAD_HOST} (scontrol requeuehold" in text, text[-3000:]
    assert cluster.wait_job(job, 600) == "COMPLETED", out.read_text()[-3000:]
    fields = cluster.job(job)
    assert fields.get("Restarts") == "1" and BAD_HOST in fields.get("ExcNodeList", ""), fields
    assert BAD_HOST not in fields.get("NodeList", ""), fields
    final = out.read_text()
    assert "step 6/6" in final or '"step": 6' in (work / "runs" / "unfit" /
                                                   "result.json").read_text(), final[-3000:]
    first = final.split("requeued the job without", 1)[0]
    assert "step 1/" not in first, "the unfit incarnation trained"
