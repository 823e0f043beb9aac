"""One node, nothing in the environment: torchrun ``--standalone`` (or the worker itself
when there is one process).

torchrun restarts all local workers when one fails, through a new rendezvous round;
on torch 2.13 that round completes only with the rendezvous store not shared
(see :mod:`.common`): with two processes and the default, the first restart fails
("connectFullMesh ... Connection refused") and the next one hangs.

Nothing of a run on one node needs another machine, so nothing listens beyond
loopback: torchrun's store is at ``localhost`` (``--standalone``) and the workers'
process group meets at ``--local-addr 127.0.0.1`` (both bound there by
:mod:`train.core.machine.binding`), and gloo (and NCCL's bootstrap) use the loopback interface
(``GLOO_SOCKET_IFNAME=lo``, ``NCCL_SOCKET_IFNAME=lo``, unless an interface is named).
"""

from __future__ import annotations

from launcher.conventions.common import RE_RENDEZVOUS_ENV, Nodes, Timings
from launcher.planning.variables import Environ

NAME = "single"
LOOPBACK = "127.0.0.1"


def detect(env: Environ) -> bool:
    return True


def nodes(env: Environ, timings: Timings) -> Nodes:
    return Nodes(NAME, args=("--standalone", "--nnodes", "1", "--local-addr", LOOPBACK),
                 env=dict(RE_RENDEZVOUS_ENV), alone=True, notes=_lone_pod_note(env))


def _lone_pod_note(env: Environ) -> tuple[str, ...]:
    """A pod of an Indexed Job not told where the store is trains alone: say so, since a
    multi-node job was likely meant."""
    index = env.get("JOB_COMPLETION_INDEX")
    if index is None:
        return ()
    return (f"JOB_COMPLETION_INDEX={index} without TRAIN_RDZV_ENDPOINT: this pod trains "
            "alone, as a single node; for one job across pods set TRAIN_RDZV_ENDPOINT, "
            "TRAIN_NNODES and TRAIN_RDZV_ID",)
