"""The launch plan of replica groups (``distributed.fault_tolerance: replicas``), on one
machine: one torchft Lighthouse, then ``distributed.replicas`` + ``distributed.spares``
groups, each ONE torchrun of ``nproc_per_node`` workers with a rendezvous of its own.

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

from launcher.conventions.common import Nodes
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

    @property
    def groups(self) -> int:
        return self.replicas + self.spares

    @property
    def address(self) -> str:
        return f"http://{HOST}:{LIGHTHOUSE_PORT}"

    def render(self, shared: dict[str, str]) -> list[str]:
        """``--dry-run``'s lines for the groups, as a shell script: the variables every
        group gets (``shared``), the Lighthouse, then each group's torchrun."""
        lines = [f"# replica groups: {self.replicas} + {self.spares} spare(s) = "
                 f"{self.groups} torchrun(s) on this machine, started once the Lighthouse "
                 "accepts connections; each restarts its own workers (--max-restarts)",
                 f"# Lighthouse at {self.address}; LIGHTHOUSE_PORT and each group's "
                 f"RDZV_PORT: free ports on {HOST}, picked at each start",
                 *(f"export {k}={shlex.quote(v)}" for k, v in shared.items()),
                 shell(self.lighthouse) + " &"]
        for g, (argv, env) in enumerate(zip(self.argvs, self.envs, strict=True)):
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


def check_one_machine(nodes: Nodes) -> None:
    """Replica groups run on one machine for now: a launch convention of a cluster
    (torchrun's variables, an Indexed Job, SLURM, Kubeflow) is exit 3."""
    if nodes.alone:
        return
    raise CannotRunHere(f"distributed.fault_tolerance=replicas runs its replica groups on "
                        f"one machine for now, but this is a {nodes.convention} job of "
                        f"{nodes.min}:{nodes.max} node(s); run it on one machine without "
                        "the launch convention's variables, or use "
                        "distributed.fault_tolerance=restart across nodes")


def rdzv_args(group: int) -> tuple[str, ...]:
    """A group's own rendezvous: c10d on 127.0.0.1 at a free port, one node; and its
    role, which torchrun puts before each line of its workers (``[group1-rank0]:``)."""
    return ("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{HOST}:{RDZV_PORT}",
            "--rdzv-id", f"replica-group-{group}", "--nnodes", "1", "--local-addr", HOST,
            "--role", f"group{group}-rank")


def processes_per_group(cfg: Config, nproc: int, gpus: int, device: str) -> int:
    """On GPUs the groups split this machine's devices, one process each: auto gives
    every group an equal share (the rest stay idle); more than there are is exit 3."""
    d = cfg.distributed
    groups = d.replicas + d.spares
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
                lighthouse: str | None, gpu_share: int = 0) -> ReplicaGroups:
    """Each group's command: ``argv`` (one node's torchrun, as the plan builds it) with
    its rendezvous flags ``standalone`` replaced by the group's own. ``gpu_share``: the
    GPUs each group takes (0 on the CPU), from its first device on."""
    d = cfg.distributed
    at = next(i for i in range(len(argv)) if tuple(argv[i:i + len(standalone)]) == standalone)
    groups = d.replicas + d.spares
    argvs = tuple((*argv[:at], *rdzv_args(g), *argv[at + len(standalone):])
                  for g in range(groups))
    envs = tuple({GROUP_VAR: str(g), GROUPS_VAR: str(groups),
                  LIGHTHOUSE_VAR: f"http://{HOST}:{LIGHTHOUSE_PORT}", ADDR_VAR: HOST,
                  **({DEVICE_OFFSET_VAR: str(g * gpu_share)} if gpu_share else {})}
                 for g in range(groups))
    bind = f"{HOST}:{LIGHTHOUSE_PORT}"
    return ReplicaGroups(d.replicas, d.spares,
                         tuple(lighthouse_argv(lighthouse or LIGHTHOUSE_BINARY, bind,
                                               Timeouts.of(d.replica_timeout_s))),
                         argvs, envs)
