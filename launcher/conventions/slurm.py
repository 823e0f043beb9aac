"""A SLURM allocation: ``SLURM_JOB_ID`` with the job step's ``SLURM_*`` variables.

Two layouts, as users write them:

- **one task per node** (``srun --ntasks-per-node=1``, torchtitan's way): the
  launcher on each node runs torchrun for the node's GPUs; nodes = the step's nodes,
  node rank = ``SLURM_NODEID``;
- **one task per GPU** (``srun --ntasks-per-node=G``, Lightning's way): each task is
  one worker, run directly with ``RANK`` = ``SLURM_PROCID``, ``WORLD_SIZE`` =
  ``SLURM_NTASKS``, ``LOCAL_RANK`` = ``SLURM_LOCALID``.

Either way the rendezvous is static on the first host of the step's node list (an
allocation is fixed: nothing joins or leaves), at ``MASTER_PORT`` when the job sets it,
else at a port derived from the job id (so jobs sharing a node do not meet by mistake),
and the tasks' launchers watch each other (launcher/liveness/heartbeat.py at that port + 1): a
lost node stops every task in seconds, naming it. The run directory's lease is the job
step's, per incarnation (``SLURM_RESTART_COUNT``): a requeued job never takes its
earlier incarnation's lease for its own.

A batch script runs on the first node only: it may start a one-node run itself, but
several nodes need ``srun``. ``TRAIN_REQUEUE_SIGNAL`` (default USR1, ``none`` to
ignore it) names the signal that ``#SBATCH --signal`` sends before the time limit: the
run checkpoints and stops like on SIGTERM, then task 0 requeues the job
(``scontrol requeue``), whose next incarnation resumes from that checkpoint.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from dataclasses import replace

from launcher.conventions import single
from launcher.conventions.common import Nodes, Timings, env_error, parse_port, static_rendezvous
from launcher.conventions.slurm_hostlist import expand
from launcher.planning.variables import Environ

NAME = "slurm"
# Its variables fall back to one another (the step's to the job's: SLURM_STEP_NODELIST,
# then SLURM_JOB_NODELIST), so asked again without a bad one it would only say the same
# problem of the next: its first problem is the one said (conventions.variable_errors).
VARIABLES_FALL_BACK = True
PORT_BASE, PORT_SPAN = 15000, 5000  # ports 15000..24999, two per job (store + heartbeat)
REQUEUE_VAR = "TRAIN_REQUEUE_SIGNAL"
DEFAULT_REQUEUE_SIGNAL = "USR1"


def detect(env: Environ) -> bool:
    return bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))


def _count(env: Environ, *names: str) -> int | None:
    """The first of ``names`` that is set, as a positive integer (None when none is)."""
    for name in names:
        value = env.get(name)
        if value is None:
            continue
        if not value.isdigit() or (int(value) < 1 and not name.endswith(("ID", "COUNT"))):
            raise env_error(name, f"got {value!r}; expected an integer")
        return int(value)
    return None


def tasks_per_node(value: str, var: str) -> list[int]:
    """SLURM's ``2(x3),1`` as [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m or int(m[1]) < 1:
            raise env_error(var, f"got {value!r}; expected counts like 2(x3),1")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


def requeue_signal(env: Environ) -> int | None:
    """The signal that means checkpoint, requeue, exit; None when switched off."""
    name = (env.get(REQUEUE_VAR) or DEFAULT_REQUEUE_SIGNAL).upper().removeprefix("SIG")
    if name == "NONE":
        return None
    allowed = ("USR1", "USR2", "URG", "HUP", "CONT")
    if name not in allowed:
        raise env_error(REQUEUE_VAR, f"got {env.get(REQUEUE_VAR)!r}; expected one of "
                                     f"{', '.join(allowed)} (as in #SBATCH --signal) or none")
    return int(getattr(signal, f"SIG{name}"))


def nodes(env: Environ, timings: Timings) -> Nodes:
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job.isdigit():
        raise env_error("SLURM_JOB_ID", f"got {job!r}; expected the job's number")
    if env.get("SLURM_HET_SIZE") or env.get("SLURM_PACK_SIZE"):
        raise env_error("SLURM_HET_SIZE", "a heterogeneous job (hetjob components): the "
                                          "launcher plans one homogeneous step; submit the "
                                          "training as a job of one component")
    in_step = env.get("SLURM_STEP_ID") is not None or env.get("SLURM_STEPID") is not None
    n_nodes = _count(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1
    if not in_step:  # the batch script (or salloc's shell)
        if n_nodes > 1:
            raise env_error("SLURM_STEP_ID", f"not set: this is the batch script of a job on "
                                             f"{n_nodes} nodes, which runs on the first node "
                                             "only; start the launcher with srun (one task "
                                             "per node, or one per GPU)")
        return _one_task_per_node(env, timings, job, "batch", 1, 0,
                                  [env.get("SLURMD_NODENAME") or "localhost"])
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    listed = env.get(var) or env.get("SLURM_NODELIST")
    if not listed:
        raise env_error(var, "not set: a job step always has a node list")
    try:
        hosts = expand(listed)
    except ValueError as exc:
        raise env_error(var, f"got {listed!r}: {exc}") from None
    if len(hosts) != n_nodes:
        raise env_error(var, f"names {len(hosts)} host(s) but the step has {n_nodes} node(s)")
    n_tasks = _count(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or n_nodes
    node_id = _count(env, "SLURM_NODEID")
    node_id = 0 if node_id is None else node_id
    if node_id >= n_nodes:
        raise env_error("SLURM_NODEID", f"got {node_id}; expected 0..{n_nodes - 1}")
    if n_tasks == n_nodes:
        return _one_task_per_node(env, timings, job, step, n_nodes, node_id, hosts)
    return _one_task_per_gpu(env, job, step, n_nodes, n_tasks, node_id, hosts)


def _port(env: Environ, job: str) -> int:
    if env.get("MASTER_PORT"):
        return parse_port(env.get("MASTER_PORT"), "MASTER_PORT")
    return PORT_BASE + 2 * (int(job) % PORT_SPAN)


def _common(env: Environ, job: str, step: str) -> dict:
    restart = _count(env, "SLURM_RESTART_COUNT") or 0
    procid = _count(env, "SLURM_PROCID") or 0
    requeue = ("scontrol", "requeue", job) if procid == 0 else None
    return {"job": f"slurm-{job}.{step}" + (f"-requeue{restart}" if restart else ""),
            "max_restarts": 0,  # a fixed allocation: a lost task ends the step
            "static": True, "requeue": requeue, "requeue_signal": requeue_signal(env)}


def earlier_incarnation(job: str | None) -> Callable[[str], bool] | None:
    """For a requeued job's lease id (``slurm-JOB.STEP-requeueN``), whether another lease
    id is one of the same job's earlier incarnations (any step, restart count below N).
    SLURM starts an incarnation only after the previous one ended, so its lease need not
    be waited for; None for any other id (nothing is known to have ended)."""
    mine = re.fullmatch(r"slurm-(\d+)\.[^-]+-requeue(\d+)", job or "")
    if mine is None:
        return None
    pattern = re.compile(rf"slurm-{mine[1]}\.[^-]+(?:-requeue(\d+))?")

    def ended(other: str) -> bool:
        theirs = pattern.fullmatch(other)
        return theirs is not None and int(theirs[1] or 0) < int(mine[2])
    return ended


def _one_task_per_node(env: Environ, timings: Timings, job: str, step: str, n_nodes: int,
                       node_id: int, hosts: list[str]) -> Nodes:
    where = "batch script" if step == "batch" else f"step {job}.{step}"
    if n_nodes == 1:  # this node alone: as without SLURM, restarts included
        note = f"launch convention: SLURM {where} on one node ({hosts[0]})"
        return replace(single.nodes(env, timings), convention=NAME, notes=(note,),
                       **{**_common(env, job, step), "max_restarts": None, "static": False})
    master = env.get("MASTER_ADDR") or hosts[0]
    port = _port(env, job)
    args = static_rendezvous(n_nodes, n_nodes, rank=node_id, addr=master, port=port,
                             timings=timings)
    note = (f"launch convention: SLURM {where}, one task per node: {n_nodes} nodes, this is "
            f"node {node_id} ({hosts[node_id]}), rendezvous at {master}:{port}")
    return Nodes(NAME, n_nodes, n_nodes, tuple(args), host=master if node_id else None,
                 heartbeat=(master, port + 1, node_id), notes=(note,),
                 replica_node=(node_id, hosts[node_id], master, port), node_hosts=tuple(hosts),
                 **_common(env, job, step))


def _one_task_per_gpu(env: Environ, job: str, step: str, n_nodes: int, n_tasks: int,
                      node_id: int, hosts: list[str]) -> Nodes:
    var = "SLURM_STEP_TASKS_PER_NODE" if env.get("SLURM_STEP_TASKS_PER_NODE") \
        else "SLURM_TASKS_PER_NODE"
    counts = tasks_per_node(env.get(var) or f"{n_tasks // n_nodes}(x{n_nodes})", var)
    if len(set(counts)) != 1 or sum(counts) != n_tasks or len(counts) != n_nodes:
        raise env_error(var, f"got {env.get(var)!r} for {n_tasks} tasks on {n_nodes} nodes: "
                             "every node must run the same number of tasks; use "
                             "--ntasks-per-node (1, or one per GPU)")
    per_node = counts[0]
    rank, local = _count(env, "SLURM_PROCID"), _count(env, "SLURM_LOCALID")
    for name, value, limit in (("SLURM_PROCID", rank, n_tasks), ("SLURM_LOCALID", local,
                                                                  per_node)):
        if value is None or value >= limit:
            raise env_error(name, f"got {env.get(name)!r}; expected 0..{limit - 1}")
    master = env.get("MASTER_ADDR") or hosts[0]
    port = _port(env, job)
    identity = {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(n_tasks),
                "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(node_id),
                "GROUP_WORLD_SIZE": str(n_nodes), "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(n_tasks), "MASTER_ADDR": master,
                "MASTER_PORT": str(port)}
    note = (f"launch convention: SLURM step {job}.{step}, one task per GPU: {n_tasks} tasks "
            f"on {n_nodes} node(s) ({per_node} per node), this is task {rank} (local "
            f"{local}) on {hosts[node_id]}, rendezvous at {master}:{port}")
    return Nodes(NAME, n_tasks, n_tasks, (), host=master if rank else None, nproc=1,
                 identity=identity, tasks_per_node=per_node,
                 heartbeat=(master, port + 1, rank) if n_tasks > 1 else None,
                 notes=(note,), **_common(env, job, step))
