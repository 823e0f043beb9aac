"""A worker process's identity and settings, read from its environment once.

torchrun (or the launcher, for a single process) gives each worker ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``
and ``TORCHELASTIC_RESTART_COUNT``; the launcher adds where to report how the worker
ended. This is the only place a worker reads them; everything else receives a
:class:`WorkerIdentity`. Torch-free: the launcher's own child processes use it too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from train.core.machine.host import DEFAULT_BUILD_MANIFEST, available_cpus
from train.core.run import replica_contract

# Set by the launcher's supervisor: the folder where each worker writes its report.
STATUS_DIR_VAR = "TRAIN_LAUNCHER_STATUS_DIR"
# Set by the supervisor when it starts torchrun again for the same run (store came back).
RELAUNCH_VAR = "TRAIN_RELAUNCH"
# Set by the supervisor: the config as the launch validated it. Every start of a worker
# in this launch (torchrun's restarts too) reads it instead of the config file, which may
# have been edited or removed since.
CONFIG_SNAPSHOT_VAR = "TRAIN_CONFIG_SNAPSHOT"
# Set by the installed command (trainpod): how the run's closing lines name the command.
COMMAND_VAR = "TRAIN_COMMAND"
# Set by the user: 0 (false, no, off) lets torch load its compiler stack as it would
# (train/distributed/compiler_stack.py keeps it unloaded in a run that compiles nothing).
KEEP_COMPILER_UNLOADED_VAR = "TRAIN_KEEP_COMPILER_UNLOADED"
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class WorkerIdentity:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_world_size: int | None = None  # torchrun: nodes in this rendezvous round
    group_rank: int | None = None        # torchrun: this node's index in the round
    restart_count: int = 0
    relaunch: int = 0                    # the launcher's relaunches of torchrun (same run)
    elastic_run_id: str | None = None    # TORCHELASTIC_RUN_ID: the torchrun job, when there is one
    status_dir: str | None = None        # the launcher's report folder, when supervised
    log_dir: str | None = None           # torchrun's per-worker log folder, when it keeps one
    build_manifest: str = DEFAULT_BUILD_MANIFEST
    code_version: str | None = None
    debug: bool = False                  # TRAIN_DEBUG: verbose communication logs
    socket_ifname: str | None = None     # TRAIN_SOCKET_IFNAME: this node's interface
    device: str | None = None            # TRAIN_DEVICE: gpu | cpu, as the launcher planned
    backend: str | None = None           # TRAIN_BACKEND: nccl | gloo | mpi, likewise
    config_snapshot: str | None = None   # TRAIN_CONFIG_SNAPSHOT: the launch's config
    master_addr: str | None = None       # MASTER_ADDR, MASTER_PORT: where the processes meet
    master_port: str | None = None       # (rank 0's store; torchrun sets both)
    omp_threads: int | None = None       # OMP_NUM_THREADS: the launcher's or the user's
    keep_compiler_unloaded: bool = True  # TRAIN_KEEP_COMPILER_UNLOADED (0: off)
    replica_group: int | None = None     # REPLICA_GROUP_ID: this worker's replica group
    replica_groups: int | None = None    # NUM_REPLICA_GROUPS: the groups started
    lighthouse: str | None = None        # TORCHFT_LIGHTHOUSE: the job's Lighthouse
    replica_addr: str | None = None      # TRAIN_REPLICA_ADDR: where other groups reach us
    device_offset: int = 0               # TRAIN_REPLICA_DEVICE_OFFSET: this group's first GPU

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> WorkerIdentity:
        env = os.environ if env is None else env

        def text(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        def num(name: str, default: int | None) -> int | None:
            value = text(name)
            return int(value) if value is not None and value.isdigit() else default

        return cls(rank=num("RANK", 0), local_rank=num("LOCAL_RANK", 0),
                   world_size=num("WORLD_SIZE", 1), local_world_size=num("LOCAL_WORLD_SIZE", 1),
                   group_world_size=num("GROUP_WORLD_SIZE", None),
                   group_rank=num("GROUP_RANK", None),
                   restart_count=num("TORCHELASTIC_RESTART_COUNT", 0),
                   relaunch=num(RELAUNCH_VAR, 0),
                   elastic_run_id=text("TORCHELASTIC_RUN_ID"),
                   status_dir=text(STATUS_DIR_VAR), log_dir=_torchrun_log_dir(env),
                   build_manifest=text("TRAIN_BUILD_MANIFEST") or DEFAULT_BUILD_MANIFEST,
                   code_version=text("TRAIN_CODE_VERSION"),
                   debug=(text("TRAIN_DEBUG") or "0").lower() in ("1", "true", "yes", "on"),
                   socket_ifname=text("TRAIN_SOCKET_IFNAME"),
                   device=text("TRAIN_DEVICE"), backend=text("TRAIN_BACKEND"),
                   config_snapshot=text(CONFIG_SNAPSHOT_VAR),
                   master_addr=text("MASTER_ADDR"), master_port=text("MASTER_PORT"),
                   omp_threads=num("OMP_NUM_THREADS", None) or None,
                   keep_compiler_unloaded=(text(KEEP_COMPILER_UNLOADED_VAR) or "1").lower()
                   not in _OFF,
                   replica_group=num(replica_contract.GROUP_VAR, None),
                   replica_groups=num(replica_contract.GROUPS_VAR, None),
                   lighthouse=text(replica_contract.LIGHTHOUSE_VAR),
                   replica_addr=text(replica_contract.ADDR_VAR),
                   device_offset=num(replica_contract.DEVICE_OFFSET_VAR, 0) or 0)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def nodes(self) -> int:
        """Nodes in this round (torchrun's GROUP_WORLD_SIZE; 1 without it)."""
        return self.group_world_size or 1

    @property
    def node(self) -> int:
        """This node's index (GROUP_RANK; else from the rank, nodes holding equal shares)."""
        if self.group_rank is not None:
            return self.group_rank
        return self.rank // max(1, self.local_world_size)

    @property
    def continuing(self) -> bool:
        """A restart or relaunch of the same attempt (not a new run of the command)."""
        return self.restart_count > 0 or self.relaunch > 0

    @property
    def supervised(self) -> bool:
        """Started by the launcher (which holds the run lock and reads our report)."""
        return self.status_dir is not None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that writes run-level files and logs metrics."""
        return self.rank == 0

    @property
    def leads_run(self) -> bool:
        """The one process that writes the run's own files (config, manifest, metrics,
        result): rank 0, of replica group 0 when there are replica groups (each group
        has its own rank 0, and its own checkpoint writer: :attr:`is_main`)."""
        return self.is_main and not self.replica_group

    @property
    def by_hand(self) -> bool:
        """Started without torchrun or the launcher (``WORLD_SIZE=2 python -m train``)."""
        return self.elastic_run_id is None and not self.supervised

    def check_rendezvous(self) -> None:
        """Several processes meet at MASTER_ADDR:MASTER_PORT: both must be set (torchrun
        sets them; a worker started by hand may lack them). ConfigError (exit 2)."""
        from train.core.errors import ConfigError
        missing = [name for name, value in (("MASTER_ADDR", self.master_addr),
                                            ("MASTER_PORT", self.master_port)) if not value]
        if self.distributed and missing:
            raise ConfigError("environment", missing[0], (
                f"not set, but WORLD_SIZE={self.world_size}: the processes meet at rank 0's "
                "MASTER_ADDR:MASTER_PORT; start them with `entrypoint.py train` (or torchrun), "
                "which sets both, or set both to rank 0's address and a free port in every one"))

    def cpus_per_rank(self) -> int:
        """This node's usable CPUs (affinity mask and cgroup quota) shared by its ranks."""
        return max(1, available_cpus() // max(1, self.local_world_size))

    def threads_per_rank(self) -> int:
        """Intra-op threads: OMP_NUM_THREADS when set (the launcher sets it, and a value
        the user set wins there too), else :meth:`cpus_per_rank` (a bare ``torchrun``)."""
        return self.omp_threads or self.cpus_per_rank()

    def check_consistent(self) -> None:
        """torchrun's WORLD_SIZE must equal nodes in this round x local processes."""
        if self.group_world_size is None:
            return
        expected = self.group_world_size * self.local_world_size
        if self.world_size != expected:
            raise RuntimeError(
                f"WORLD_SIZE={self.world_size} but GROUP_WORLD_SIZE={self.group_world_size} x "
                f"LOCAL_WORLD_SIZE={self.local_world_size} = {expected}: every node must run "
                f"the same distributed.nproc_per_node")


# torchrun's variables a worker reads: (name, the least value allowed)
_COUNTS = (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_WORLD_SIZE", 1),
           ("GROUP_RANK", 0), ("GROUP_WORLD_SIZE", 1), ("TORCHELASTIC_RESTART_COUNT", 0))


def check_environ(env: Mapping[str, str] | None = None) -> None:
    """A worker started by hand (``RANK=1 python -m train``) with variables torchrun would
    never set: ConfigError (exit 2) naming the first one, instead of a silent default or a
    traceback from inside torch."""
    from train.core.errors import ConfigError
    env = os.environ if env is None else env
    got: dict[str, int] = {}
    for name, least in _COUNTS:
        value = env.get(name, "").strip()
        if not value:
            continue
        if not value.isdigit() or int(value) < least:
            raise ConfigError("environment", name, f"got {value!r}; expected an integer "
                                                   f">= {least}")
        got[name] = int(value)
    for index, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if index in got and got[index] >= got.get(size, 1):
            raise ConfigError("environment", index, f"got {got[index]}, but {size}="
                                                    f"{got.get(size, 1)}: expected 0.."
                                                    f"{got.get(size, 1) - 1}")
    port = env.get("MASTER_PORT", "").strip()
    if port and (not port.isdigit() or not 0 < int(port) < 65536):
        raise ConfigError("environment", "MASTER_PORT", f"got {port!r}; expected a port "
                                                        "1..65535")


def _torchrun_log_dir(env: Mapping[str, str]) -> str | None:
    """torchrun writes each worker's stdout.log/stderr.log beside its error file when it
    runs with --log-dir; without it the output went to the console."""
    error_file = env.get("TORCHELASTIC_ERROR_FILE", "").strip()
    log_dir = os.path.dirname(error_file) if error_file else None
    if log_dir and os.path.isfile(os.path.join(log_dir, "stderr.log")):
        return log_dir
    return None
