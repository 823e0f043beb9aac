"""A Kubernetes Indexed Job from this project's manifests (``TRAIN_RDZV_ENDPOINT``, and
``JOB_COMPLETION_INDEX`` from the Job controller), or any node told where the store is.

Worker pods meet at the standalone rendezvous store (``entrypoint.py rendezvous``,
behind a Service) with ``is_host=false``, so no worker pod holds the store and losing
any of them costs a re-rendezvous, not the job. Variables:

- ``TRAIN_RDZV_ENDPOINT``: host:port of the store (port default 29400);
- ``TRAIN_NNODES``: ``N`` or ``MIN:MAX`` nodes;
- ``TRAIN_RDZV_ID``: an id unique to the job (the Job's uid, from the pod label
  ``batch.kubernetes.io/controller-uid``): the store outlives jobs, and a reused id
  names a closed rendezvous that refuses new nodes;
- ``TRAIN_LOCAL_ADDR``: this pod's address for its peers (the pod IP), so no peer
  needs DNS for it;
- ``TORCHFT_LIGHTHOUSE``: ``http://HOST:PORT`` of the replica groups' Lighthouse, its
  own Deployment + Service (k8s/kustomize/replicas): with
  ``distributed.fault_tolerance: replicas`` each pod runs ONE replica group, its id
  ``JOB_COMPLETION_INDEX`` (:func:`launcher.planning.replica_plan.nodes_for_groups`).
"""

from __future__ import annotations

from launcher.conventions import common
from launcher.conventions.common import Nodes, Timings
from launcher.planning.variables import Environ, integer
from train.core.errors import ConfigError, raise_all
from train.core.run.replica_contract import LIGHTHOUSE_VAR

NAME = "indexed-job"


def detect(env: Environ) -> bool:
    """TRAIN_RDZV_ENDPOINT selects it (a pod of this project's manifests, or any node
    told where the store is); JOB_COMPLETION_INDEX, when set, must be an index."""
    integer(env.raw, "JOB_COMPLETION_INDEX")  # validated wherever it is set
    return bool(env.get("TRAIN_RDZV_ENDPOINT"))


def _settings(env: Environ) -> tuple[tuple[int, int], str, tuple[str, int]]:
    """The node range, the run id and the store; every problem among them at once."""
    nnodes, run_id = env.get("TRAIN_NNODES"), env.get("TRAIN_RDZV_ID")
    errors: list[ConfigError] = []
    nodes_range = endpoint = None
    if not nnodes:
        errors.append(common.env_error("TRAIN_NNODES",
                                       "required with TRAIN_RDZV_ENDPOINT: N or MIN:MAX nodes"))
    if not run_id:
        errors.append(common.env_error(
            "TRAIN_RDZV_ID", "required with TRAIN_RDZV_ENDPOINT: a value unique to the job "
                             "(the pod label batch.kubernetes.io/controller-uid); a reused "
                             "id makes the store refuse new nodes"))
    try:
        nodes_range = common.parse_nnodes(nnodes, "TRAIN_NNODES") if nnodes else None
    except ConfigError as exc:
        errors.append(exc)
    try:
        endpoint = common.parse_endpoint(env.get("TRAIN_RDZV_ENDPOINT"), "TRAIN_RDZV_ENDPOINT")
    except ConfigError as exc:
        errors.append(exc)
    raise_all(errors)
    return nodes_range, run_id, endpoint


def nodes(env: Environ, timings: Timings) -> Nodes:
    (lo, hi), run_id, (host, port) = _settings(env)
    # The store outlives the agents: a restart is a new round even at one node.
    args, out_env = common.dynamic_rendezvous(lo, hi, endpoint=(host, port), run_id=run_id,
                                              own_conf={"is_host": "false"},
                                              re_rendezvous=True, timings=timings)
    local = env.get("TRAIN_LOCAL_ADDR")
    if local:
        args += ["--local-addr", local]
    index = env.get("JOB_COMPLETION_INDEX")
    by = f"JOB_COMPLETION_INDEX={index}" if index else "TRAIN_RDZV_ENDPOINT"
    note = (f"launch convention: Indexed Job ({by}), standalone rendezvous store {host}:{port}, "
            f"nodes {lo}:{hi}")
    return Nodes(NAME, lo, hi, tuple(args), out_env, host, job=run_id,
                 store=f"{host}:{port}", notes=(note,),
                 replica_node=_replica_pod(env, index, local),
                 lighthouse_by="its Deployment's" if env.get(LIGHTHOUSE_VAR) else None)


def _replica_pod(env: Environ, index: str | None, local: str | None
                 ) -> tuple[int, str, str, int] | None:
    """Where this pod's replica group finds the Lighthouse the manifests run (``http://
    HOST:PORT`` in TORCHFT_LIGHTHOUSE): (its index, its address, the Lighthouse's host
    and port); None without the Lighthouse or an index (replica groups then exit 3)."""
    url = env.get(LIGHTHOUSE_VAR)
    if not url or index is None:
        return None
    host, port = common.parse_endpoint(url.removeprefix("http://").rstrip("/"),
                                       LIGHTHOUSE_VAR, default_port=29510)
    return int(index), local or host_name(), host, port


def host_name() -> str:
    import socket
    return socket.gethostname()
