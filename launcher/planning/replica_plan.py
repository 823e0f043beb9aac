"""The launch plan of replica groups (``distributed.fault_tolerance: replicas``), on one
machine: one torchft Lighthouse, then ``distributed.replicas`` + ``distributed.spares``
groups, each ONE torchrun of ``nproc_per_node`` workers with a rendezvous of its own.

On a cluster (:mod:`launcher.planning.replica_nodes`: SLURM, one task per node, or an
Indexed Job of k8s/kustomize/replicas) each node runs its part of ONE group: the whole
group under a one-node torchrun when each group is one node, else one torchrun per node
meeting the group's other nodes. The Lighthouse is node 0's on SLURM (started by its
launcher at the job's port: ``MASTER_PORT``, else derived from the job id,
:func:`launcher.conventions.slurm._port`, which every node computes alone), its own
Deployment's on Kubernetes; the groups reach it, and each other, at the nodes' names
(SLURM's node list) or the pods' IPs (``TRAIN_LOCAL_ADDR``).

Pure, like :mod:`launcher.planning.plan`: the ports are free ones the supervisor
(:mod:`launcher.running.replica_groups`) picks on 127.0.0.1 at each start, so the
commands hold them as shell variables (``${LIGHTHOUSE_PORT}``, ``${RDZV_PORT}``), which
``--dry-run`` prints as they are and the supervisor fills in.

A group's workers learn their group and the Lighthouse from the variables of
:mod:`train.core.run.replica_contract`; each group keeps torchrun's own restarts
(``--max-restarts``), so a group restarts its workers while the others train on.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from launcher.planning.replica_nodes import GroupNode
from train.core.config import AUTO, Config
from train.core.errors import CannotRunHere
from train.core.run.replica_contract import (
    ADDR_VAR,
    DEVICE_OFFSET_VAR,
    GROUP_VAR,
    GROUPS_VAR,
    LIGHTHOUSE_VAR,
    Timeouts,
    lighthouse_argv,
)

LIGHTHOUSE_BINARY = "torchft_lighthouse"
HOST = "127.0.0.1"
LIGHTHOUSE_PORT = "${LIGHTHOUSE_PORT}"
RDZV_PORT = "${RDZV_PORT}"


@dataclass(frozen=True)
class ReplicaGroups:
    """The Lighthouse and the groups' commands; ports as ``${...}`` until a start."""
    replicas: int                       # groups that share each global batch
    spares: int                         # hot spare groups
    lighthouse: tuple[str, ...]         # its argv, bound to 127.0.0.1:${LIGHTHOUSE_PORT}
    argvs: tuple[tuple[str, ...], ...]  # each group's torchrun, rendezvous at ${RDZV_PORT}
    envs: tuple[dict[str, str], ...]    # each group's own variables, on top of the plan's
    ids: tuple[int, ...] = ()           # the groups started here (default: all of them)
    # on SLURM: the first node's host:port, fixed; whether this node starts it (node 0)
    at: str | None = None
    serve: bool = True
    # who runs it when no launcher does (Kubernetes: its Deployment, which replaces a
    # lost one: each pod's launcher then starts its group again); None: a launcher
    owner: str | None = None
    per_group: int = 1                  # a cluster job: nodes (pods) of each group
    group_rank: int = 0                 # ... and this one's place among its group's

    @property
    def by(self) -> str:
        """Whose Lighthouse this is, for the lines that name it."""
        return self.owner or ("this launcher's" if self.serve else "node 0's")

    @property
    def groups(self) -> int:
        return self.replicas + self.spares

    @property
    def here(self) -> tuple[int, ...]:
        return self.ids or tuple(range(self.groups))

    @property
    def address(self) -> str:
        return f"http://{self.at or f'{HOST}:{LIGHTHOUSE_PORT}'}"

    def render(self, shared: dict[str, str]) -> list[str]:
        """``--dry-run``'s lines for the groups, as a shell script: the variables every
        group gets (``shared``), the Lighthouse, then each group's torchrun."""
        if self.at:
            one = "pod" if self.owner else "node"
            each = f"one per {one}" if self.per_group == 1 else \
                f"{self.per_group} {one}s each; this is the group's {one} {self.group_rank}"
            where = (f"# replica group {self.here[0]} of {self.groups} on this {one} "
                     f"({self.replicas} + {self.spares} spare(s), {each})",
                     f"# Lighthouse at {self.address}: " + ("started here" if self.serve
                                                          else f"{self.by}, waited for"))
        else:
            where = (f"# replica groups: {self.replicas} + {self.spares} spare(s) = "
                     f"{self.groups} torchrun(s) on this machine, started once the "
                     "Lighthouse accepts connections; each restarts its own workers "
                     "(--max-restarts)",
                     f"# Lighthouse at {self.address}; LIGHTHOUSE_PORT and each group's "
                     f"RDZV_PORT: free ports on {HOST}, picked at each start")
        lines = [*where, *(f"export {k}={shlex.quote(v)}" for k, v in shared.items())]
        if self.serve:
            lines.append(shell(self.lighthouse) + " &")
        for g, argv, env in zip(self.here, self.argvs, self.envs, strict=True):
            kind = "replica" if g < self.replicas else "spare"
            lines.append(f"# group {g} ({kind})")
            lines += [f"{k}={quote(v)} \\" for k, v in env.items()]
            lines.append(shell(argv) + " &")
        return [*lines, "wait"]


def quote(arg: str) -> str:
    """shlex's quoting, but a ``${PORT}`` variable stays one the shell fills in."""
    if "${" in arg and all(c not in arg for c in "\"`\\ '"):
        return f'"{arg}"'
    return shlex.quote(arg)


def shell(argv: tuple[str, ...] | list[str]) -> str:
    return " ".join(quote(a) for a in argv)


def fill(argv: tuple[str, ...], **ports: int) -> list[str]:
    """The argv with its ``${NAME}`` ports replaced by the numbers picked now."""
    out = list(argv)
    for name, port in ports.items():
        out = [a.replace("${" + name + "}", str(port)) for a in out]
    return out


def groups_here(cfg: Config, node: GroupNode | None) -> int:
    """How many torchruns this machine runs: the groups, one per node on SLURM, else 1."""
    d = cfg.distributed
    return d.replicas + d.spares if d.fault_tolerance == "replicas" and not node else 1


def rdzv_args(group: int) -> tuple[str, ...]:
    """A group's own rendezvous: c10d on 127.0.0.1 at a free port, one node; and its
    role, which torchrun puts before each line of its workers (``[group1-rank0]:``)."""
    return ("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{HOST}:{RDZV_PORT}",
            "--rdzv-id", f"replica-group-{group}", "--nnodes", "1", "--local-addr", HOST,
            "--role", f"group{group}-rank")


def processes_per_group(cfg: Config, nproc: int, gpus: int, device: str,
                        groups: int) -> int:
    """On GPUs the ``groups`` of this machine split its devices, one process each: auto
    gives every group an equal share (the rest stay idle); more than there are is exit 3."""
    d = cfg.distributed
    if device != "gpu":
        return nproc
    if d.nproc_per_node == AUTO:
        nproc = gpus // groups
    if nproc < 1 or nproc * groups > gpus:
        need = max(nproc, 1) * groups
        raise CannotRunHere(f"{groups} replica groups (distributed.replicas + spares) of "
                            f"{max(nproc, 1)} process(es) need {need} GPUs, one each; {gpus} "
                            "usable here: fewer groups, a smaller distributed.nproc_per_node, "
                            "or device=cpu")
    return nproc


def plan_groups(cfg: Config, argv: list[str], standalone: tuple[str, ...],
                lighthouse: str | None, node: GroupNode | None = None,
                gpu_share: int = 0, owner: str | None = None) -> ReplicaGroups:
    """Each group's command: ``argv`` (one node's torchrun, as the plan builds it) with
    its rendezvous flags ``standalone`` replaced by the group's own. ``node`` (a cluster
    job: :mod:`launcher.planning.replica_nodes`): this node's part of its group alone,
    the Lighthouse at the job's; a group of several nodes keeps ``argv``'s rendezvous,
    the group's. ``gpu_share``: the GPUs each group of this machine takes (0 on the
    CPU), from its first device on. ``owner``: who runs the Lighthouse when no launcher
    does (Kubernetes: its Deployment)."""
    d = cfg.distributed
    groups = d.replicas + d.spares
    ids = (node.group,) if node else tuple(range(groups))
    bind = node.lighthouse if node else f"{HOST}:{LIGHTHOUSE_PORT}"
    if node and node.per_group > 1:
        argvs = (tuple(argv),)
    else:
        at = next(i for i in range(len(argv))
                  if tuple(argv[i:i + len(standalone)]) == standalone)
        argvs = tuple((*argv[:at], *rdzv_args(g), *argv[at + len(standalone):]) for g in ids)
    envs = tuple({GROUP_VAR: str(g), GROUPS_VAR: str(groups), LIGHTHOUSE_VAR: f"http://{bind}",
                  ADDR_VAR: node.addr if node else HOST,
                  **({DEVICE_OFFSET_VAR: str(i * gpu_share)} if gpu_share else {})}
                 for i, g in enumerate(ids))
    return ReplicaGroups(d.replicas, d.spares,
                         tuple(lighthouse_argv(lighthouse or LIGHTHOUSE_BINARY, bind,
                                               Timeouts.of(d.replica_timeout_s))),
                         argvs, envs, ids=ids if node else (), at=bind if node else None,
                         serve=node is None or (owner is None and node.node == 0),
                         owner=owner, per_group=node.per_group if node else 1,
                         group_rank=node.rank if node else 0)
