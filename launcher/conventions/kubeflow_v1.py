"""Kubeflow PyTorchJob v1 (non-elastic): ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``
and ``RANK`` describe *pods*, not processes.

``WORLD_SIZE`` is the number of pods and ``RANK`` this pod's index; torchrun's static
rendezvous turns that into ``--nnodes WORLD_SIZE --node-rank RANK`` and gives the
workers its own ``WORLD_SIZE`` = pods x processes per pod. Inside torchrun (a worker)
the same names mean processes, so the convention does not apply there.
"""

from __future__ import annotations

from launcher.conventions.common import (
    Nodes,
    Timings,
    env_error,
    heartbeat_of,
    parse_port,
    static_rendezvous,
)
from launcher.planning.variables import Environ

NAME = "kubeflow-v1"
DEFAULT_MASTER_PORT = "29500"


def detect(env: Environ) -> bool:
    return all(env.get(k) for k in ("MASTER_ADDR", "WORLD_SIZE", "RANK")) \
        and not env.get("TORCHELASTIC_RUN_ID")


def nodes(env: Environ, timings: Timings) -> Nodes:
    n, rank, addr = env.get("WORLD_SIZE"), env.get("RANK"), env.get("MASTER_ADDR")
    for var, value in (("WORLD_SIZE", n), ("RANK", rank)):
        if not value.isdigit():
            raise env_error(var, f"got {value!r}; expected an integer")
    pods, index = int(n), int(rank)
    if pods < 1 or index >= pods:
        raise env_error("RANK", f"got {rank}; expected 0..{pods - 1} (WORLD_SIZE={n} pods)")
    port = parse_port(env.get("MASTER_PORT") or DEFAULT_MASTER_PORT, "MASTER_PORT")
    note = (f"launch convention: Kubeflow PyTorchJob v1 (WORLD_SIZE={n} pods, this pod RANK="
            f"{rank}); torchrun gives the workers WORLD_SIZE = pods x nproc_per_node")
    return Nodes(NAME, pods, pods,
                 tuple(static_rendezvous(pods, pods, rank=index, addr=addr, port=port,
                                       timings=timings)),
                 host=addr if index != 0 else None, job=f"kubeflow:{addr}:{port}",
                 max_restarts=0,  # a restart cannot bring back a lost pod: exit, restart pods
                 static=True, heartbeat=heartbeat_of(addr, port, index, pods),
                 notes=(note,))
