"""Where a cluster job's replica groups run (``distributed.fault_tolerance: replicas``):
which group this node (pod) belongs to, and how the nodes of one group meet.

The job's nodes are the groups, in order, each of the same number of nodes: with
``distributed.replicas`` + ``distributed.spares`` = G groups and N nodes (N a multiple
of G), group g is the nodes ``g x N/G .. (g + 1) x N/G - 1``. Every node's launcher
plans its own part of its own group:

- **one node per group** (N = G): a torchrun of this node alone, its own rendezvous on
  127.0.0.1 (:func:`launcher.planning.replica_plan.rdzv_args`), as on one machine;
- **several nodes per group**: one torchrun per node, meeting the group's other nodes
  at a c10d rendezvous of the group alone (id ``JOB-groupG``), so that a failure
  restarts that group's workers on its nodes and no other group's. On SLURM its store
  is held by the agent of the group's first node, at the job's port + 1 (node 0 holds
  the Lighthouse at the job's port; replica groups use no heartbeat port); on
  Kubernetes it is the Job's standalone rendezvous store (``TRAIN_RDZV_ENDPOINT``),
  which outlives any pod. Losing a group's rendezvous store (its first node, on SLURM)
  loses that group, whose slot a spare or the survivors take.

The Lighthouse is node 0's on SLURM (started by its launcher), its own Deployment's on
Kubernetes; every group reaches it, and each other, at the nodes' addresses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from launcher.conventions.common import (
    Nodes,
    Timings,
    dynamic_rendezvous,
    env_error,
    nnodes_arg,
    parse_endpoint,
)
from train.core.config import Config
from train.core.errors import CannotRunHere, ConfigError

# On SLURM a group of several nodes meets at its first node, at the job's port + this
GROUP_RDZV_PORT_OFFSET = 1


@dataclass(frozen=True)
class GroupNode:
    """This node's (pod's) place among a cluster job's replica groups."""
    node: int            # its index in the job: SLURM_NODEID, JOB_COMPLETION_INDEX
    addr: str            # where the other groups reach it
    lighthouse: str      # host:port of the job's Lighthouse
    per_group: int = 1   # nodes (pods) of each group

    @property
    def group(self) -> int:
        return self.node // self.per_group

    @property
    def rank(self) -> int:
        """Its place among its group's nodes (0: the group's first)."""
        return self.node % self.per_group

    def span(self) -> str:
        """The group's nodes, as the lines about it name them."""
        first = self.group * self.per_group
        return f"{first}..{first + self.per_group - 1}"


def nodes_for_groups(nodes: Nodes, cfg: Config, source: str, timings: Timings
                     ) -> tuple[Nodes, GroupNode | None]:
    """Where replica groups run (nodes, and this node's place, as they are without
    them): one machine; a SLURM step of one task per node; or an Indexed Job's pods with
    the Lighthouse's Service in TORCHFT_LIGHTHOUSE (k8s/kustomize/replicas). The nodes
    returned are this node's group's: one (its own torchrun, as on one machine) or the
    group's nodes meeting at the group's own rendezvous. Any other launch convention of
    a cluster is exit 3; nodes that do not split into the groups, exit 2."""
    d = cfg.distributed
    if d.fault_tolerance != "replicas" or nodes.alone:
        return nodes, None
    if nodes.replica_node is None:
        raise CannotRunHere(f"distributed.fault_tolerance=replicas runs its replica groups "
                            f"on one machine, on SLURM (one task per node) or in an Indexed "
                            f"Job with TORCHFT_LIGHTHOUSE (k8s/kustomize/replicas), but this "
                            f"is a {nodes.convention} job of {nodes.min}:{nodes.max} node(s); "
                            "run it on one machine without the launch convention's "
                            "variables, or use distributed.fault_tolerance=restart")
    place = _place(nodes, d.replicas, d.spares, source)
    pods = nodes.lighthouse_by is not None  # Kubernetes: the Job's pods, TRAIN_NNODES
    if place.per_group == 1:
        return replace(nodes, min=1, max=1, heartbeat=None, static=False, host=None,
                       notes=_notes(nodes, place, pods), store=None, max_restarts=None,
                       env={} if pods else nodes.env), place
    args, env = _group_rendezvous(nodes, place, pods, timings)
    if pods:  # the Job's store, which the launcher waits for as without replicas
        host, store = nodes.host, nodes.store
    else:  # the group's first node holds its store; the others wait for its name
        host = _first_host(nodes, place) if place.rank else None
        store, env = None, {**nodes.env, **env}
    return replace(nodes, min=place.per_group, max=place.per_group, args=args, env=env,
                   heartbeat=None, static=False, host=host, store=store,
                   notes=_notes(nodes, place, pods), max_restarts=None), place


def _first_host(nodes: Nodes, place: GroupNode) -> str:
    """SLURM: the name of the first node of this node's group."""
    return nodes.node_hosts[place.group * place.per_group]


def _place(nodes: Nodes, replicas: int, spares: int, source: str) -> GroupNode:
    """This node's group, once the job's nodes are known to split into the groups."""
    groups = replicas + spares
    node, addr, host, port = nodes.replica_node
    pods = nodes.lighthouse_by is not None
    one = "pod" if pods else "node"
    if nodes.min != nodes.max or nodes.max % groups:
        have = (f"TRAIN_NNODES is {nnodes_arg(nodes.min, nodes.max)} (the Job's pods)" if pods
                else f"the SLURM step has {nodes.max} node(s)")
        fix = ("set TRAIN_NNODES, completions and parallelism to a multiple of it" if pods
               else "ask for a multiple of it in nodes")
        raise ConfigError(source, "distributed.replicas", f"{replicas} replica(s) + "
                          f"{spares} spare(s) (distributed.spares) are {groups} replica "
                          f"groups of as many {one}s each, but {have}; {fix}")
    if node >= nodes.max:
        raise env_error("JOB_COMPLETION_INDEX", f"got {node}; expected 0..{nodes.max - 1}, "
                                                "one index per pod")
    return GroupNode(node, addr, f"{host}:{port}", nodes.max // groups)


def _group_rendezvous(nodes: Nodes, place: GroupNode, pods: bool, timings: Timings
                      ) -> tuple[tuple[str, ...], dict[str, str]]:
    """The torchrun flags and worker variables that make this node one of its group's:
    a c10d rendezvous of the group alone, at the job's store (Kubernetes) or the group's
    first node (SLURM), this node presenting itself at its own address."""
    if pods:
        endpoint, is_host = parse_endpoint(nodes.store, "TRAIN_RDZV_ENDPOINT"), False
    else:
        job_port = nodes.replica_node[3]
        endpoint = (_first_host(nodes, place), job_port + GROUP_RDZV_PORT_OFFSET)
        is_host = place.rank == 0
    args, env = dynamic_rendezvous(
        place.per_group, place.per_group, endpoint=endpoint,
        run_id=f"{nodes.job}-group{place.group}",
        own_conf={"is_host": "true" if is_host else "false"}, re_rendezvous=True,
        timings=timings)
    return (*args, "--local-addr", place.addr, "--role", f"group{place.group}-rank"), env


def _notes(nodes: Nodes, place: GroupNode, pods: bool) -> tuple[str, ...]:
    groups = nodes.max // place.per_group
    one = "pod" if pods else "node"
    mine = f"replica group {place.group} of {groups}"
    if place.per_group > 1:
        mine = (f"its part of {mine} ({one}s {place.span()}, {place.per_group} per group; "
                f"this is the group's {one} {place.rank})")
    if pods:
        return (f"launch convention: Indexed Job (JOB_COMPLETION_INDEX={place.node}): this "
                f"pod runs {mine}, the Lighthouse at {place.lighthouse} "
                f"({nodes.lighthouse_by})",)
    _, _, first, port = nodes.replica_node
    return tuple(n.replace(f"rendezvous at {first}:{port}", f"this node runs {mine}, the "
                           f"Lighthouse at {place.lighthouse}") for n in nodes.notes)
