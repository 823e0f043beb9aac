"""The launch plan: a pure function from (config, hardware, torch build, environment)
to the argv and environment variables that start training. ``train --dry-run``
prints it; tests compare it against golden values. No I/O happens here.

Decisions, in order: device (gpu | cpu) -> backend -> nodes (the launch convention,
:mod:`launcher.conventions`) -> processes per node -> the global batch must divide
for every world size in MIN..MAX nodes -> argv + worker variables. Invalid input
anywhere raises ConfigError (exit 2); valid input this machine or image cannot run
raises CannotRunHere (exit 3).

One process on one node runs the worker directly (the launcher supervises and
restarts it, like torchrun would); anything else runs torchrun (through
:mod:`launcher.torchrun`, which only quiets its traceback on a signal).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import asdict, dataclass
from typing import Any

from launcher import conventions
from launcher.conventions import Nodes
from launcher.detection.compat import check_build
from launcher.detection.hardware import Hardware, TorchBuild
from launcher.planning.replica_nodes import nodes_for_groups
from launcher.planning.replica_plan import (
    ReplicaGroups,
    groups_here,
    plan_groups,
    processes_per_group,
)
from launcher.planning.variables import Environ
from launcher.planning.worker_variables import WorkerVariables, direct_worker_identity
from train.core.config import AUTO, Config, batch_split
from train.core.config import tracking as tracker_config
from train.core.config.checks import check_batch_memory, check_model_memory
from train.core.config.origins import config_warnings, origin_note, source_of
from train.core.errors import CannotRunHere, ConfigError
from train.core.machine.comm_defaults import worker_defaults
from train.core.machine.placement import (
    backend_problem,
    check_gpu_only,
    one_process_problem,
    resolve_backend,
    runs_one_process,
)
from train.core.machine.threads import SPIN_COUNT, WAIT_POLICY, thread_defaults
from train.core.run import rundir

WORKER_MODULE = "train.worker"
SHUTDOWN_TIMEOUT_VAR = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun's --shutdown-timeout
SCRIPT_MODULE = "train.script"


@dataclass(frozen=True)
class Plan:
    mode: str                        # direct | torchrun
    argv: tuple[str, ...]
    env: dict[str, str]              # set on top of the inherited environment
    device: str                      # gpu | cpu
    backend: str                     # nccl | gloo | mpi
    nproc_per_node: int
    nnodes: tuple[int, int]
    world_sizes: tuple[int, ...]
    max_restarts: int
    convention: str
    job: str | None = None           # shared by every node of the job (the run lock's id)
    store: str | None = None         # host:port of a rendezvous store to wait for when lost
    store_wait_s: int = 0
    join_timeout_s: int = 0          # how long the rendezvous waits for the minimum of nodes
    lost_after_s: float = 0          # a node silent this long has vanished
    silence_s: float = 20            # static: a node that answers but does not beat: frozen
    heartbeat: tuple[str, int, int] | None = None  # static: (rank-0 address, port, rank)
    static_nodes: bool = False       # several nodes, static rendezvous: none can be replaced
    program: str = "train"           # train (the trainer) | script (entrypoint.py launch)
    requeue: tuple[str, ...] | None = None  # run after a stop by requeue_signal (SLURM)
    requeue_signal: int | None = None
    rdzv_host: str | None = None
    log_dir: str | None = None
    # fault_tolerance=replicas: a Lighthouse and a torchrun per group (argv: group 0's)
    replica_groups: ReplicaGroups | None = None
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def liveness(self) -> tuple[str, ...]:
        """The watchers this run's launcher gets (:mod:`launcher.liveness.watchers`): an
        elastic job with a store watches the rendezvous rounds, a static job's nodes beat
        at the rank-0 node, one node alone watches nothing."""
        if self.store and self.job:
            return ("rounds",)
        return ("heartbeat",) if self.heartbeat else ()

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def render(self, data: list[str] = ()) -> str:
        """What ``--dry-run`` prints: the decisions (and ``data``: lines about the dataset)
        as comments, then a command a shell can run as it is."""
        lines = ["# launch plan (dry run: nothing was started)",
                 f"# mode={self.mode} device={self.device} backend={self.backend} "
                 f"nproc_per_node={self.nproc_per_node} nnodes={self.nnodes[0]}:"
                 f"{self.nnodes[1]} world_sizes={','.join(map(str, self.world_sizes))} "
                 f"max_restarts={self.max_restarts} convention={self.convention}"]
        lines += [f"# note: {n}" for n in self.notes]
        lines += [f"# warning: {w}" for w in self.warnings]
        lines += [f"# data: {line}" for line in data]
        if self.rdzv_host:
            lines.append(f"# before starting: wait until {self.rdzv_host} resolves")
        if self.replica_groups:  # several commands: the shared variables exported
            return "\n".join(lines + self.replica_groups.render(self.env))
        lines += [f"{k}={shlex.quote(v)} \\" for k, v in self.env.items()]
        lines.append(shlex.join(self.argv))
        return "\n".join(lines)


def resolve_device(cfg: Config, hw: Hardware, tb: TorchBuild, hsa_override: str | None,
                   notes: list[str]) -> str:
    if cfg.device == "cpu":
        if hw.gpus:
            notes.append(f"device=cpu: ignoring {len(hw.gpus)} GPU(s)")
        return "cpu"
    problems = [f for f in check_build(hw, tb, hsa_override) if f.level == "fail"]
    if problems:  # GPUs are here but this image's torch cannot drive them
        p = problems[0]
        raise CannotRunHere(f"{p.message}; {p.fix}")
    if hw.gpus:
        return "gpu"
    if cfg.device == "gpu":
        why = "; ".join(hw.warnings + hw.notes) or "no GPU found"
        raise CannotRunHere(f"device=gpu but no usable GPU here ({why}); run with --gpus all "
                            "(NVIDIA) or --device /dev/kfd --device /dev/dri (AMD), or set "
                            "device=cpu")
    return "cpu"


def check_backend_built(backend: str, tb: TorchBuild) -> None:
    problem = backend_problem(backend, {"nccl": tb.nccl, "gloo": tb.gloo, "mpi": tb.mpi},
                              tb.version)
    if problem:
        raise CannotRunHere(problem)


def resolve_nproc(cfg: Config, hw: Hardware, device: str, nodes: Nodes, source: str,
                  notes: list[str]) -> int:
    strategy = cfg.distributed.strategy
    one = runs_one_process(strategy)
    if one and nodes.max > 1:
        raise CannotRunHere(one_process_problem(
            strategy, f"this environment launches {nodes.min}:{nodes.max} nodes "
                      f"({nodes.convention})"))
    want = cfg.distributed.nproc_per_node
    if want != AUTO:
        if nodes.nproc is not None and nodes.nproc != want:
            notes.append(f"distributed.nproc_per_node={want} (config) wins over "
                         f"PET_NPROC_PER_NODE={nodes.nproc}")
        if one and want > 1:
            source = source_of(cfg, "distributed.nproc_per_node", source)
            raise ConfigError(source, "distributed.nproc_per_node", f"got {want}, but "
                              f"distributed.strategy={strategy}"
                              f"{origin_note(cfg, 'distributed.strategy', source)} runs one "
                              "process; use ddp or fsdp, or nproc_per_node=1")
        n = want
    elif nodes.nproc is not None:
        n = nodes.nproc
    elif one or device == "cpu":
        n = 1
    else:
        n = len(hw.gpus)
    if nodes.tasks_per_node and device == "gpu":
        check_gpus_per_task(len(hw.gpus), nodes.tasks_per_node)
    if one and n > 1:
        raise CannotRunHere(one_process_problem(
            strategy, f"this environment asks for {n} processes per node (PET_NPROC_PER_NODE)"))
    if device == "gpu" and strategy != "dp" and n > len(hw.gpus):
        raise CannotRunHere(f"{n} processes per node need {n} GPUs, but {len(hw.gpus)} "
                            "is/are usable here; lower distributed.nproc_per_node (or leave it "
                            "auto), or check the visibility variables (doctor)")
    return n


def check_gpus_per_task(gpus: int, tasks_per_node: int) -> None:
    """One task per GPU: each task sees its own GPU, or all of the node's (one each)."""
    if gpus not in (1, tasks_per_node):
        raise ConfigError("environment", "SLURM_NTASKS_PER_NODE",
                          f"{tasks_per_node} tasks per node, but each task sees {gpus} GPUs: "
                          f"run one task per GPU (--ntasks-per-node={gpus}), give each task "
                          "one (--gpus-per-task=1), or run one task per node")


def world_sizes(cfg: Config, nodes: Nodes, nproc: int) -> tuple[int, ...]:
    if cfg.distributed.fault_tolerance == "replicas":  # the logical world: every group's
        return (cfg.distributed.replicas * nproc * nodes.max,)
    if runs_one_process(cfg.distributed.strategy):
        return (1,)
    return tuple(n * nproc for n in range(nodes.min, nodes.max + 1))


def check_batch_splits(cfg: Config, sizes: tuple[int, ...], nodes: Nodes, nproc: int,
                       source: str, memory_per_rank: int | None) -> None:
    """The global batch must split, and fit, for every world size the node range allows."""
    for size in sizes:
        try:
            batch_split(cfg, size, source)
            check_batch_memory(cfg, size, source, memory_per_rank)
        except ConfigError as exc:
            if nodes.max == nodes.min:
                raise
            raise ConfigError(exc.source, exc.key, f"{exc.problem} (at {size // nproc} of "
                              f"{nodes.min}:{nodes.max} nodes x {nproc} process(es); every "
                              "world size in the range must divide it)") from None


def _state_memory(cfg: Config, hw: Hardware, device: str, nproc: int,
                  host: int | None) -> tuple[int | None, str]:
    """Where each process keeps the model's state, and how much of it there is."""
    on_host = device != "gpu" or (cfg.distributed.strategy == "fsdp" and cfg.memory.cpu_offload)
    if on_host:
        return host, f"host memory available to each of the {nproc} process(es) here"
    sizes = [g.memory_bytes for g in hw.gpus if g.memory_bytes]
    if not sizes:
        return None, ""
    return min(sizes), f"memory of one {hw.gpus[0].name}"


def worker_variables(cfg: Config, hw: Hardware, device: str, backend: str, nproc: int,
                     nodes: Nodes, environ: Environ, app_root: str, direct: bool,
                     master_port: int, max_restarts: int) -> WorkerVariables:
    v = WorkerVariables(environ)
    path = environ.get("PYTHONPATH") or ""
    if app_root not in path.split(":"):  # workers run `-m train.worker` from any cwd
        v.force("PYTHONPATH", app_root + (":" + path if path else ""))
    v.force("PYTHONUNBUFFERED", "1")
    v.force("PYTHONFAULTHANDLER", "1")  # a crashing worker prints every thread's stack
    v.defaults(thread_defaults(hw.cpus, nproc, environ.raw))
    if environ.get(SPIN_COUNT) and not environ.get("OMP_WAIT_POLICY"):
        v.kept.append(f"{SPIN_COUNT}={environ.get(SPIN_COUNT)} (set by you: it chooses how "
                      f"OpenMP threads wait; the launcher would set OMP_WAIT_POLICY={WAIT_POLICY})")
    # The node's variable wins over the config: interfaces can differ between nodes.
    v.defaults(worker_defaults(
        gpu=device == "gpu", backend=backend, vendor=hw.vendor,
        deterministic=cfg.deterministic, run_dir=cfg.run_dir,
        debug=environ.debug or cfg.distributed.debug,
        socket_ifname=environ.socket_ifname or cfg.distributed.socket_ifname,
        loopback=nodes.alone))
    if not direct:  # the convention's torchrun settings
        v.defaults(nodes.env)
        # torchrun SIGKILLs its workers this long after forwarding SIGTERM: the stop
        # checkpoint gets the platform's grace, less a margin for torchrun to exit.
        v.default(SHUTDOWN_TIMEOUT_VAR, str(cfg.distributed.grace_period_s - 5))
    if direct:
        identity = nodes.identity or direct_worker_identity(master_port, max_restarts)
        for name, value in {**identity, "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}.items():
            v.force(name, value)
    return v


def plan(cfg: Config, hw: Hardware, tb: TorchBuild, environ: Environ, *, config_path: str,
         overrides: list[str], python: str, app_root: str, master_port: int = 29500,
         script: list[str] | None = None, lighthouse: str | None = None) -> Plan:
    """Decide everything about the launch; raise ConfigError (2) or CannotRunHere (3).

    script: ``launch``'s program instead of the trainer (``[path, args...]`` or
    ``["-m", module, args...]``); it runs under ``train.script``, which reports how
    it ended as a training worker does, and learns the plan's device and backend from
    TRAIN_DEVICE and TRAIN_BACKEND. The global batch is the trainer's business only.
    lighthouse: torchft's Lighthouse binary as found here (fault_tolerance=replicas).
    """
    source = str(config_path)
    notes: list[str] = []
    device = resolve_device(cfg, hw, tb, environ.visibility.hsa_override_gfx_version, notes)
    check_gpu_only(cfg, device == "gpu", source)
    backend = resolve_backend(cfg.distributed.backend, device == "gpu")
    check_backend_built(backend, tb)
    d = cfg.distributed
    # torch's agents drop a silent member after keep-alive x attempts: stretched to
    # heartbeat_silence_s, since each node's round watcher evicts a member whose host is
    # gone sooner, and a starved one keeps its place meanwhile (launcher.liveness.pulse)
    expiry_attempts = max(d.rdzv_keep_alive_attempts,
                          math.ceil(d.heartbeat_silence_s / d.rdzv_keep_alive_s))
    timings = conventions.Timings(d.rdzv_join_timeout_s, d.rdzv_last_call_s,
                                  d.rdzv_keep_alive_s, expiry_attempts)
    nodes = conventions.resolve(environ, timings)
    replicas = cfg.distributed.fault_tolerance == "replicas"
    nodes, node = nodes_for_groups(nodes, cfg, source, timings)  # a cluster's: this node's group
    notes.extend(nodes.notes)
    nproc = resolve_nproc(cfg, hw, device, nodes, source, notes)
    nproc = processes_per_group(cfg, nproc, len(hw.gpus), device, groups_here(cfg, node)) \
        if replicas else nproc
    local = nproc * groups_here(cfg, node)  # processes on this machine
    sizes = world_sizes(cfg, nodes, nproc)
    if script is None:
        tracker_config.check(cfg, source, environ.raw)
        host = hw.memory_available // local if hw.memory_available else None
        check_batch_splits(cfg, sizes, nodes, nproc, source, host)
        check_model_memory(cfg, min(sizes), *_state_memory(cfg, hw, device, nproc, host),
                           gpu=device == "gpu")
    max_restarts = cfg.distributed.max_restarts if nodes.max_restarts is None \
        else nodes.max_restarts
    # one process: the launcher is its torchrun (one node alone, or one task per GPU)
    direct = nproc == 1 and (nodes.alone or nodes.identity is not None) and not replicas
    variables = worker_variables(cfg, hw, device, backend, local, nodes, environ, app_root,
                                 direct, master_port, max_restarts)
    if script is None:
        worker = [WORKER_MODULE, source, *overrides, f"device={device}",
                  f"distributed.backend={backend}"]
    else:
        worker = [SCRIPT_MODULE, *script]
        variables.force("TRAIN_DEVICE", device)
        variables.force("TRAIN_BACKEND", backend)
    log_dir = None
    if direct:
        argv = [python, "-m", *worker]
    else:
        log_dir = str(cfg.run_dir / rundir.LOGS)
        argv = [python, "-m", "launcher.torchrun", *nodes.args, "--nproc-per-node",
                str(nproc), "--max-restarts", str(max_restarts), "--log-dir", log_dir,
                "--tee", "3", "-m", *worker]
    groups = plan_groups(cfg, argv, nodes.args, lighthouse, node,
                         gpu_share=nproc * (device == "gpu"),
                         owner=nodes.lighthouse_by) if replicas else None
    # The config's own warnings (values it adjusted) first: the launcher prints them
    # once, and the workers it starts leave them to it.
    warnings = config_warnings(cfg) + list(hw.warnings) + [f"kept {k}" for k in variables.kept]
    if device == "gpu" and backend == "gloo":
        warnings.append("distributed.backend=gloo on GPUs is much slower than nccl")
    return Plan(mode="direct" if direct else "torchrun",
                argv=groups.argvs[0] if groups else tuple(argv), env=variables.values,
                device=device, backend=backend, nproc_per_node=nproc,
                nnodes=(nodes.min, nodes.max), world_sizes=sizes, max_restarts=max_restarts,
                convention=nodes.convention, job=nodes.job, store=nodes.store,
                store_wait_s=d.rdzv_store_wait_s, join_timeout_s=d.rdzv_join_timeout_s,
                # a member this silent has vanished, unless its host answers (one
                # more beat than rdzv_keep_alive_attempts)
                lost_after_s=d.rdzv_keep_alive_s * (d.rdzv_keep_alive_attempts + 1),
                silence_s=d.heartbeat_silence_s,
                heartbeat=nodes.heartbeat if nodes.static else None,
                static_nodes=nodes.static and nodes.max > 1,
                program="train" if script is None else "script",
                requeue=nodes.requeue, requeue_signal=nodes.requeue_signal,
                rdzv_host=nodes.host,
                log_dir=log_dir, replica_groups=groups,
                notes=tuple(notes), warnings=tuple(warnings))
