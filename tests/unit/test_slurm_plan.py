"""The SLURM launch convention as golden plans: both layouts (one task per node, one per
GPU), the batch script, SLURM's hostlist syntax, and the allocations it refuses.

The variables are those a task of ``srun`` sees on slurm-wlm 22.05 (the real cluster
of tests/e2e/test_slurm.py prints them); plan() is pure, so the machines are made up.
"""

from __future__ import annotations

import signal

import pytest

from launcher.conventions.slurm_hostlist import expand
from tests.harness.plans import BASE_ENV, CUDA_TORCH, PY, SHUTDOWN, gpus, make, torchrun
from train.core.errors import ConfigError


def step(nodes: int, tasks_per_node: int, *, procid: int = 0, job: str = "4242",
         nodelist: str = "gpu[07-08]", **extra: str) -> dict[str, str]:
    """The environment of one task of `srun -N nodes --ntasks-per-node tasks_per_node`."""
    tasks = nodes * tasks_per_node
    per_node = f"{tasks_per_node}(x{nodes})" if nodes > 1 else str(tasks_per_node)
    return {"SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
            "SLURM_NNODES": str(nodes), "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_NTASKS": str(tasks), "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_JOB_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
            "SLURM_NODELIST": nodelist, "SLURM_TASKS_PER_NODE": per_node,
            "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_PROCID": str(procid),
            "SLURM_NODEID": str(procid // tasks_per_node),
            "SLURM_LOCALID": str(procid % tasks_per_node), **extra}


@pytest.mark.parametrize("hostlist, hosts", [
    ("node1", ["node1"]),
    ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
    ("a[08-10]", ["a08", "a09", "a10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x[1-2]-ib,y", ["x1-ib", "x2-ib", "y"]),
])
def test_hostlists_expand_as_scontrol_show_hostnames_does(hostlist, hosts):
    assert expand(hostlist) == hosts


@pytest.mark.parametrize("hostlist, why", [
    ("gpu[1-2", "'[' without ']'"), ("gpu1-2]", "']' without '['"), ("a,,b", "empty name"),
    ("a[2-1]", "runs backwards"), ("a[]", "empty brackets"), ("a[x]", "not a number"),
    ("a[1-999999999]", "more than 100000"), ("r[1-1000]n[1-1000]", "more than 100000"),
    ("a[[1]]", "nested"),
])
def test_malformed_hostlists_say_what_is_wrong(hostlist, why):
    with pytest.raises(ValueError, match=r".*") as err:
        expand(hostlist)
    assert why in str(err.value)


def test_one_task_per_node_runs_torchrun_for_the_nodes_gpus(cfg_file):
    path = cfg_file()
    p = make(path, hw=gpus(4), tb=CUDA_TORCH, env=step(2, 1, procid=1))
    port = 15000 + 2 * (4242 % 5000)
    assert p.convention == "slurm" and p.nnodes == (2, 2) and p.world_sizes == (8,)
    assert list(p.argv) == torchrun(
        "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "static", "--master-addr",
        "gpu07", "--master-port", str(port), "--rdzv-conf", "timeout=600", nproc=4,
        restarts=0) + [path, "device=gpu", "distributed.backend=nccl"]
    assert p.rdzv_host == "gpu07" and p.heartbeat == ("gpu07", port + 1, 1)
    assert p.job == "slurm-4242.0" and p.static_nodes and p.requeue is None
    assert p.requeue_signal == signal.SIGUSR1


def test_one_task_per_gpu_makes_each_task_one_worker(cfg_file):
    path = cfg_file()
    p = make(path, hw=gpus(4), tb=CUDA_TORCH, env=step(2, 4, procid=6))
    port = 15000 + 2 * (4242 % 5000)
    assert p.mode == "direct" and p.nproc_per_node == 1 and p.world_sizes == (8,)
    assert list(p.argv) == ["/opt/venv/bin/python", "-m", "train.worker", path, "device=gpu",
                            "distributed.backend=nccl"]
    identity = {"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "6",
                "ROLE_WORLD_SIZE": "8", "MASTER_ADDR": "gpu07", "MASTER_PORT": str(port),
                "TORCHELASTIC_MAX_RESTARTS": "0"}
    assert {k: p.env[k] for k in identity} == identity
    assert p.heartbeat == ("gpu07", port + 1, 6) and p.rdzv_host == "gpu07"


def test_task_zero_requeues_and_an_incarnation_has_its_own_lease(cfg_file):
    first = make(cfg_file(), env=step(2, 1, procid=0))
    again = make(cfg_file(), env=step(2, 1, procid=0, SLURM_RESTART_COUNT="1"))
    assert first.requeue == ("scontrol", "requeue", "4242") and first.rdzv_host is None
    assert first.job == "slurm-4242.0" and again.job == "slurm-4242.0-requeue1"


def test_jobs_sharing_a_node_meet_at_different_ports(cfg_file):
    ports = {make(cfg_file(), env=step(2, 1, job=str(j))).heartbeat[1] for j in (1, 2, 3)}
    assert len(ports) == 3 and all(15000 <= p < 25000 for p in ports)
    fixed = make(cfg_file(), env=step(2, 1, MASTER_PORT="31000", MASTER_ADDR="head"))
    assert fixed.heartbeat == ("head", 31001, 0)


def test_a_one_node_batch_script_trains_without_srun(cfg_file):
    env = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "gpu01",
           "SLURMD_NODENAME": "gpu01", "SLURM_PROCID": "0"}
    p = make(cfg_file(), hw=gpus(2), tb=CUDA_TORCH, env=env)
    assert p.convention == "slurm" and p.nproc_per_node == 2 and p.nnodes == (1, 1)
    # torchrun --standalone picks a free port: another job may share the node
    assert list(p.argv[:6]) == [PY, "-m", "launcher.torchrun", "--standalone", "--nnodes", "1"]
    assert p.job == "slurm-77.batch" and p.requeue == ("scontrol", "requeue", "77")
    assert p.max_restarts == 3 and not p.static_nodes  # one node restarts its workers
    one = make(cfg_file(), env=env)  # one process: the worker itself, as without SLURM
    assert one.mode == "direct" and one.requeue == ("scontrol", "requeue", "77")
    assert p.env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == SHUTDOWN["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
    assert p.env["PYTHONPATH"] == BASE_ENV["PYTHONPATH"]


def test_variables_set_for_torchrun_win_inside_a_slurm_job(cfg_file):
    env = {**step(2, 1), "PET_NNODES": "2", "PET_RDZV_ENDPOINT": "head:29400",
           "PET_RDZV_ID": "mine"}
    assert make(cfg_file(), env=env).convention == "torchrun-env"
    env = {**step(2, 1), "MASTER_ADDR": "head", "WORLD_SIZE": "2", "RANK": "0"}
    assert make(cfg_file(), env=env).convention == "slurm"


def test_the_requeue_signal_is_configurable(cfg_file):
    p = make(cfg_file(), env=step(1, 1, nodelist="n1", TRAIN_REQUEUE_SIGNAL="SIGUSR2"))
    assert p.requeue_signal == signal.SIGUSR2
    p = make(cfg_file(), env=step(1, 1, nodelist="n1", TRAIN_REQUEUE_SIGNAL="none"))
    assert p.requeue_signal is None


@pytest.mark.parametrize("env, hw, key, words", [
    ({"SLURM_JOB_ID": "5", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}, None,
     "SLURM_STEP_ID", "start the launcher with srun"),
    (step(2, 1, nodelist="n[1-2"), None, "SLURM_STEP_NODELIST", "'[' without ']'"),
    (step(2, 1, nodelist="n[1-3]"), None, "SLURM_STEP_NODELIST", "names 3 host(s)"),
    ({**step(2, 2), "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "2,1"}, None,
     "SLURM_STEP_TASKS_PER_NODE", "every node must run the same number of tasks"),
    ({**step(2, 1), "SLURM_HET_SIZE": "2"}, None, "SLURM_HET_SIZE", "heterogeneous"),
    (step(2, 4), gpus(8), "SLURM_NTASKS_PER_NODE", "each task sees 8 GPUs"),
    (step(1, 1, nodelist="n1", TRAIN_REQUEUE_SIGNAL="KILL"), None, "TRAIN_REQUEUE_SIGNAL",
     "expected one of USR1"),
    (step(2, 1, job="12a"), None, "SLURM_JOB_ID", "the job's number"),
])
def test_an_allocation_the_plan_cannot_use_is_one_line(cfg_file, env, hw, key,
                                                       words):
    with pytest.raises(ConfigError) as err:
        make(cfg_file(), hw=hw or gpus(4), tb=CUDA_TORCH, env=env)
    line = err.value.one_line()
    assert err.value.key == key and err.value.exit_code == 2, line
    assert words in line and "\n" not in line


def test_a_refused_requeue_is_one_warning_not_a_failure(tmp_path):
    from launcher.running.requeue import requeue
    said: list[str] = []
    refuse = ("sh", "-c", "echo 'scontrol: error: Requested operation is presently "
                          "disabled for job 7' >&2; exit 1")
    assert requeue(refuse, said.append) is False
    intent, line = said
    assert intent.startswith("requeueing the job (sh -c ")
    assert line.startswith("warning: the job was not requeued (sh -c ")
    assert ": scontrol: error: Requested operation is presently disabled for job 7); " in line
    assert "`sbatch --requeue`" in line and "resumes from the checkpoint just written" in line
    assert requeue(("true",), said.append) is True and "requeueing the job" in said[-1]
    assert requeue(("/no/such/scontrol",), said.append) is False
    assert said[-1].startswith("note: no /no/such/scontrol here (inside a container?)")
