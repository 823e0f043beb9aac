"""What every launch convention produces (:class:`Nodes`), and the pieces they share:
parsing node counts and endpoints, and the torchrun rendezvous flags.

Two rendezvous styles exist. *Static* (``--rdzv-backend static``): a fixed number of
nodes, each told its rank and the rank-0 node's address; nothing can join or leave.
*Dynamic* (c10d): nodes meet at a store, MIN:MAX of them form a round, and a node
that leaves or joins starts a new round (re-rendezvous).

Re-rendezvous needs two settings on torch 2.13 (measured with torchrun agents on
127.0.0.1 and the standalone store):

- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it, any round after the first
  with two or more agents completes and then stalls in the agents' rank assignment
  (the family of failures in pytorch/pytorch#123678). With it, the workers' process
  group uses a store hosted by the rank-0 agent at its address, so that address must
  be reachable from the other nodes (``--local-addr``).
- short timeouts (:class:`Timings`, from ``distributed.rdzv_*``): a dead node leaves
  the rendezvous once its keep-alive expires (torch's default 5 s x 3 attempts), and
  once the minimum of nodes is there a round waits ``last_call_timeout`` (torch's
  default 30 s) for more. After losing a node, that wait is standstill: measured on
  simulated nodes, 30 of the 42 s between the loss and the survivor's next step.

``--rdzv-conf`` entries the user gives (``PET_RDZV_CONF``) win.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from train.core.errors import ConfigError

DEFAULT_RDZV_PORT = 29400
RE_RENDEZVOUS_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass(frozen=True)
class Timings:
    """Rendezvous timeouts in whole seconds (torch reads them as integers)."""
    join_timeout_s: int = 600
    last_call_s: int = 3
    keep_alive_s: int = 2
    keep_alive_attempts: int = 3

    def dynamic_conf(self) -> dict[str, str]:
        return {"join_timeout": str(self.join_timeout_s),
                "last_call_timeout": str(self.last_call_s),
                "keep_alive_interval": str(self.keep_alive_s),
                "keep_alive_max_attempt": str(self.keep_alive_attempts)}

    def static_conf(self) -> dict[str, str]:
        return {"timeout": str(self.join_timeout_s)}


@dataclass(frozen=True)
class Nodes:
    """How this node joins the job, as one launch convention reads the environment."""
    convention: str
    min: int = 1
    max: int = 1
    args: tuple[str, ...] = ()       # torchrun rendezvous flags
    env: dict[str, str] = field(default_factory=dict)  # defaults for the workers' environment
    host: str | None = None          # must resolve before starting (multi-node)
    max_restarts: int | None = None  # from the environment, when it says
    nproc: int | None = None         # from the environment, when it says
    job: str | None = None           # what every node of this job shares (None: one launch)
    store: str | None = None         # host:port of the rendezvous store (dynamic, multi-node)
    static: bool = False             # static rendezvous: fixed nodes, none can be replaced
    alone: bool = False              # this node alone (torchrun --standalone, or no torchrun)
    # static, several nodes: where the nodes' launchers meet to watch each other
    # (launcher/liveness/heartbeat.py): the rank-0 node's address, a port, this node's rank
    heartbeat: tuple[str, int, int] | None = None
    # one worker per task, started directly: its RANK, WORLD_SIZE, MASTER_ADDR & co.
    identity: dict[str, str] | None = None
    tasks_per_node: int | None = None  # with identity: the workers on each node
    requeue: tuple[str, ...] | None = None  # the command that requeues the job, on the
    requeue_signal: int | None = None       # task that does it, after this signal's stop
    # SLURM, one task per node on several: (this node's id, its host, the first host, the
    # job's port), where replica groups find their Lighthouse (launcher.planning.replica_plan)
    replica_node: tuple[int, str, str, int] | None = None
    node_hosts: tuple[str, ...] = ()  # SLURM: the step's hosts, by node id
    # who runs that Lighthouse when no launcher of the job does (Kubernetes: its own
    # Deployment, k8s/kustomize/replicas); None: node 0's launcher (SLURM)
    lighthouse_by: str | None = None
    notes: tuple[str, ...] = ()


def env_error(var: str, problem: str) -> ConfigError:
    return ConfigError("environment", var, problem)


def parse_nnodes(value: str, var: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` with 1 <= MIN <= MAX."""
    lo, sep, hi = value.partition(":")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        a = b = 0
    if a < 1 or b < a:
        raise env_error(var, f"got {value!r}; expected N or MIN:MAX with 1 <= MIN <= MAX")
    return a, b


def nnodes_arg(lo: int, hi: int) -> str:
    return f"{lo}:{hi}" if lo != hi else str(lo)


def parse_port(value: str, var: str) -> int:
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise env_error(var, f"got {value!r}; expected a port 1..65535")
    return int(value)


def parse_endpoint(value: str, var: str, default_port: int = DEFAULT_RDZV_PORT
                   ) -> tuple[str, int]:
    """host:port, [v6]:port or a bare host (default port)."""
    v = value.strip()
    if v.startswith("["):
        host, _, rest = v[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif v.count(":") == 1:
        host, port = v.split(":")
    else:
        host, port = v, ""
    port = port or str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise env_error(var, f"got {value!r}; expected host:port")
    return host, int(port)


def parse_rdzv_conf(value: str, var: str) -> dict[str, str]:
    """``key=value,key=value`` as torchrun's --rdzv-conf takes it."""
    conf = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise env_error(var, f"got {value!r}; expected key=value,...")
        conf[key.strip()] = val.strip()
    return conf


def conf_arg(conf: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in conf.items())


# The nodes of a static job watch each other at the rank-0 node's MASTER_PORT + this
# (torchrun's own store is at MASTER_PORT; nothing else of the job uses the next one).
HEARTBEAT_PORT_OFFSET = 1


def heartbeat_of(addr: str | None, port: int | None, rank: int | None, nnodes: int
                 ) -> tuple[str, int, int] | None:
    """Where a static job's nodes watch each other, when there are several."""
    if nnodes < 2 or not addr or port is None or rank is None:
        return None
    return addr, port + HEARTBEAT_PORT_OFFSET, rank


def static_rendezvous(lo: int, hi: int, *, rank: int | None, addr: str | None,
                      port: int | None, timings: Timings) -> list[str]:
    """Fixed nodes; a restart cannot bring back a lost one, so a lost node ends the run
    on every node (the pods' restart policy restarts them, and they resume)."""
    args = ["--nnodes", nnodes_arg(lo, hi)]
    if rank is not None:
        args += ["--node-rank", str(rank)]
    args += ["--rdzv-backend", "static"]
    if addr:
        args += ["--master-addr", addr]
    if port is not None:
        args += ["--master-port", str(port)]
    if hi > 1:
        args += ["--rdzv-conf", conf_arg(timings.static_conf())]
    return args


def dynamic_rendezvous(lo: int, hi: int, *, backend: str = "c10d",
                       endpoint: tuple[str, int] | None = None, run_id: str | None = None,
                       own_conf: Mapping[str, str] | None = None,
                       user_conf: Mapping[str, str] | None = None,
                       re_rendezvous: bool, timings: Timings) -> tuple[list[str], dict[str, str]]:
    """torchrun flags and worker variables for a dynamic (c10d) rendezvous.

    re_rendezvous: rounds after the first can happen (several nodes, or a standalone
    store that outlives the agents), so the settings in the module docstring apply.
    """
    args = ["--nnodes", nnodes_arg(lo, hi), "--rdzv-backend", backend]
    if endpoint:
        args += ["--rdzv-endpoint", f"{endpoint[0]}:{endpoint[1]}"]
    if run_id:
        args += ["--rdzv-id", run_id]
    conf = {**(own_conf or {}), **(timings.dynamic_conf() if re_rendezvous else {}),
            **(user_conf or {})}
    if conf:
        args += ["--rdzv-conf", conf_arg(conf)]
    return args, dict(RE_RENDEZVOUS_ENV) if re_rendezvous else {}
