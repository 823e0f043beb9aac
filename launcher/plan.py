"""The launch plan: a pure function from (config, hardware, torch build, environment)
to the argv and environment variables that start training. ``train --dry-run``
prints it; tests compare it against golden values. No I/O happens here.

Decisions, in order: device (gpu | cpu) -> backend -> nodes (from the launch
convention in the environment) -> processes per node -> strategy checks -> the
global batch must divide for every world size in MIN..MAX nodes -> argv + env.
Invalid input anywhere raises ConfigError (exit 2); valid input this machine or
image cannot run raises CannotRunHere (exit 3).

One process on one node runs the worker directly (the launcher supervises and
restarts it, like torchrun would); anything else runs torchrun.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from launcher.detect import check_build
from launcher.environ import Environ
from launcher.hardware import Hardware, TorchBuild
from train.config import AUTO, Config, batch_split
from train.errors import CannotRunHere, ConfigError

WORKER_MODULE = "launcher.worker"
DEFAULT_RDZV_PORT = 29400
# A dead node leaves the rendezvous after keep_alive_interval x keep_alive_max_attempt
# seconds (default 5 x 3); shorter lets survivors re-rendezvous sooner (FACTS.md).
MULTINODE_RDZV_CONF = {"keep_alive_interval": "2", "keep_alive_max_attempt": "3"}


@dataclass(frozen=True)
class Nodes:
    """How this node joins the job, from the launch convention."""
    convention: str
    min: int = 1
    max: int = 1
    args: tuple[str, ...] = ()       # torchrun rendezvous flags
    env: dict[str, str] = field(default_factory=dict)
    host: str | None = None          # must resolve before starting (multi-node)
    max_restarts: int | None = None  # from the environment, when it says
    nproc: int | None = None         # from the environment, when it says
    notes: tuple[str, ...] = ()


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
    rdzv_host: str | None = None
    log_dir: str | None = None
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "argv": list(self.argv), "env": dict(self.env),
                "device": self.device, "backend": self.backend,
                "nproc_per_node": self.nproc_per_node, "nnodes": list(self.nnodes),
                "world_sizes": list(self.world_sizes), "max_restarts": self.max_restarts,
                "convention": self.convention, "rdzv_host": self.rdzv_host,
                "log_dir": self.log_dir, "notes": list(self.notes),
                "warnings": list(self.warnings)}


# ----------------------------------------------------------------------------- device

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


def resolve_backend(cfg: Config, device: str, tb: TorchBuild, source: str) -> str:
    backend = cfg.distributed.backend
    if backend == AUTO:
        backend = "nccl" if device == "gpu" else "gloo"
    if backend == "nccl" and device == "cpu":
        _needs_gpu(cfg, source, "distributed.backend",
                   "nccl needs GPUs but device is cpu; use gloo (or auto)",
                   "distributed.backend=nccl needs GPUs, and none is usable here; use backend "
                   "auto/gloo, or run on a GPU machine")
    available = {"nccl": tb.nccl, "gloo": tb.gloo, "mpi": tb.mpi}
    if not available[backend]:
        raise CannotRunHere(f"distributed.backend={backend}: torch {tb.version} was built "
                            f"without {backend}; use "
                            + ("auto" if backend != "gloo" else "another backend")
                            + (" (MPI needs a torch built from source against MPI)"
                               if backend == "mpi" else ""))
    return backend


# ------------------------------------------------------------------------------ nodes

def parse_nnodes(value: str, var: str) -> tuple[int, int]:
    lo, sep, hi = value.partition(":")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        a = b = 0
    if a < 1 or b < a:
        raise ConfigError("environment", var, f"got {value!r}; expected N or MIN:MAX with "
                          "1 <= MIN <= MAX")
    return a, b


def parse_endpoint(value: str, var: str, default_port: int) -> tuple[str, int]:
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
        raise ConfigError("environment", var, f"got {value!r}; expected host:port")
    return host, int(port)


def parse_rdzv_conf(value: str, var: str) -> dict[str, str]:
    conf = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise ConfigError("environment", var, f"got {value!r}; expected key=value,...")
        conf[key.strip()] = val.strip()
    return conf


def _conf_arg(conf: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in conf.items())


def _int_env(env: Environ, flag: str) -> int | None:
    value = env.pet.get(flag)
    if value is None or value in ("auto", "gpu", "cpu"):
        return None
    if not value.isdigit():
        raise ConfigError("environment", f"PET_{flag}", f"got {value!r}; expected an integer")
    return int(value)


def resolve_nodes(env: Environ) -> Nodes:
    convention = env.convention
    if convention == "torchrun-env":
        return _torchrun_env(env)
    if convention == "kubeflow-v1":
        return _kubeflow_v1(env)
    if convention == "indexed-job":
        return _indexed_job(env)
    return Nodes("single", args=("--standalone", "--nnodes", "1"))


def _torchrun_env(env: Environ) -> Nodes:
    pet = env.pet
    lo, hi = parse_nnodes(pet.get("NNODES", "1"), "PET_NNODES")
    endpoint = pet.get("RDZV_ENDPOINT")
    backend = pet.get("RDZV_BACKEND") or ("c10d" if endpoint else "static")
    args = ["--nnodes", f"{lo}:{hi}" if lo != hi else str(lo), "--rdzv-backend", backend]
    out_env: dict[str, str] = {}
    host = None
    notes = [f"launch convention: torchrun PET_* variables (PET_NNODES={pet.get('NNODES', '1')})"]
    if backend == "static":
        addr, port = pet.get("MASTER_ADDR"), pet.get("MASTER_PORT")
        rank = _int_env(env, "NODE_RANK")
        if hi > 1 and (not addr or rank is None):
            raise ConfigError("environment", "PET_MASTER_ADDR" if not addr else "PET_NODE_RANK",
                              "static rendezvous over several nodes needs PET_MASTER_ADDR, "
                              "PET_MASTER_PORT and PET_NODE_RANK (or use c10d with "
                              "PET_RDZV_ENDPOINT)")
        for flag, value in (("--master-addr", addr), ("--master-port", port),
                            ("--node-rank", None if rank is None else str(rank))):
            if value:
                args += [flag, value]
        host = addr if (hi > 1 and rank != 0) else None
    else:
        conf = parse_rdzv_conf(pet.get("RDZV_CONF", ""), "PET_RDZV_CONF")
        if hi > 1 and not endpoint:
            raise ConfigError("environment", "PET_RDZV_ENDPOINT", f"required for {backend} "
                              f"rendezvous over {lo}:{hi} nodes: host:port of the store")
        if endpoint:
            host, port = parse_endpoint(endpoint, "PET_RDZV_ENDPOINT", DEFAULT_RDZV_PORT)
            args += ["--rdzv-endpoint", f"{host}:{port}"]
        run_id = pet.get("RDZV_ID")
        if not run_id and conf.get("is_host", "").lower() in ("false", "0"):
            raise ConfigError("environment", "PET_RDZV_ID", "required with a standalone "
                              "rendezvous store (is_host=false): use a value unique to the job, "
                              "e.g. its uid; the default 'none' makes the store refuse new "
                              "nodes (RendezvousClosedError)")
        if run_id:
            args += ["--rdzv-id", run_id]
        if hi > 1:
            conf = {**MULTINODE_RDZV_CONF, **conf}
            out_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if conf:
            args += ["--rdzv-conf", _conf_arg(conf)]
        if hi == 1:
            host = None
    local = pet.get("LOCAL_ADDR") or env.train_local_addr
    if local:
        args += ["--local-addr", local]
    return Nodes("torchrun-env", lo, hi, tuple(args), out_env, host,
                 max_restarts=_int_env(env, "MAX_RESTARTS"),
                 nproc=_int_env(env, "NPROC_PER_NODE"), notes=tuple(notes))


def _kubeflow_v1(env: Environ) -> Nodes:
    kf = env.kubeflow
    n = kf["WORLD_SIZE"]
    rank = kf["RANK"]
    for var, value in (("WORLD_SIZE", n), ("RANK", rank)):
        if not value.isdigit():
            raise ConfigError("environment", var, f"got {value!r}; expected an integer")
    if int(n) < 1 or int(rank) >= int(n):
        raise ConfigError("environment", "RANK", f"got {rank}; expected 0..{int(n) - 1} "
                          f"(WORLD_SIZE={n} pods)")
    port = kf.get("MASTER_PORT", "29500")
    if not port.isdigit():
        raise ConfigError("environment", "MASTER_PORT", f"got {port!r}; expected a port")
    args = ("--nnodes", n, "--node-rank", rank, "--rdzv-backend", "static",
            "--master-addr", kf["MASTER_ADDR"], "--master-port", port)
    note = (f"launch convention: Kubeflow PyTorchJob v1 (WORLD_SIZE={n} pods, this pod RANK="
            f"{rank}); torchrun gives the workers WORLD_SIZE = pods x nproc_per_node")
    return Nodes("kubeflow-v1", int(n), int(n), args,
                 host=kf["MASTER_ADDR"] if int(rank) != 0 else None, notes=(note,))


def _indexed_job(env: Environ) -> Nodes:
    if not env.train_nnodes:
        raise ConfigError("environment", "TRAIN_NNODES", "required with TRAIN_RDZV_ENDPOINT: "
                          "N or MIN:MAX nodes")
    if not env.train_rdzv_id:
        raise ConfigError("environment", "TRAIN_RDZV_ID", "required with TRAIN_RDZV_ENDPOINT: a "
                          "value unique to the job (the pod label batch.kubernetes.io/"
                          "controller-uid); a reused id makes the store refuse new nodes")
    lo, hi = parse_nnodes(env.train_nnodes, "TRAIN_NNODES")
    host, port = parse_endpoint(env.train_rdzv_endpoint or "", "TRAIN_RDZV_ENDPOINT",
                                DEFAULT_RDZV_PORT)
    conf = {"is_host": "false", **MULTINODE_RDZV_CONF}
    args = ["--nnodes", f"{lo}:{hi}" if lo != hi else str(lo), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", env.train_rdzv_id,
            "--rdzv-conf", _conf_arg(conf)]
    if env.train_local_addr:
        args += ["--local-addr", env.train_local_addr]
    note = (f"launch convention: Indexed Job (JOB_COMPLETION_INDEX={env.job_completion_index}), "
            f"standalone rendezvous store {host}:{port}, nodes {lo}:{hi}")
    return Nodes("indexed-job", lo, hi, tuple(args),
                 {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, host, notes=(note,))


# -------------------------------------------------------------------------- processes

def resolve_nproc(cfg: Config, hw: Hardware, device: str, nodes: Nodes, source: str,
                  notes: list[str]) -> int:
    strategy = cfg.distributed.strategy
    want = cfg.distributed.nproc_per_node
    if want != AUTO:
        if nodes.nproc is not None and nodes.nproc != want:
            notes.append(f"distributed.nproc_per_node={want} (config) wins over "
                         f"PET_NPROC_PER_NODE={nodes.nproc}")
        if strategy in ("single", "dp") and want > 1:
            raise ConfigError(source, "distributed.nproc_per_node", f"got {want}, but "
                              f"distributed.strategy={strategy} runs one process; use ddp or "
                              "fsdp, or nproc_per_node=1")
        n = want
    elif nodes.nproc is not None:
        n = nodes.nproc
    elif strategy in ("single", "dp") or device == "cpu":
        n = 1
    else:
        n = len(hw.gpus)
    if strategy in ("single", "dp") and n > 1:
        raise CannotRunHere(f"this environment asks for {n} processes per node "
                            f"(PET_NPROC_PER_NODE), but distributed.strategy={strategy} runs "
                            "one; use ddp or fsdp")
    if device == "gpu" and strategy != "dp" and n > len(hw.gpus):
        raise CannotRunHere(f"{n} processes per node need {n} GPUs, but {len(hw.gpus)} "
                            "is/are usable here; lower distributed.nproc_per_node (or leave it "
                            "auto), or check the visibility variables (doctor)")
    return n


def check_strategy(cfg: Config, device: str, nodes: Nodes, source: str) -> None:
    strategy = cfg.distributed.strategy
    if strategy in ("single", "dp") and nodes.max > 1:
        raise CannotRunHere(f"distributed.strategy={strategy} runs one process, but this "
                            f"environment launches {nodes.min}:{nodes.max} nodes "
                            f"({nodes.convention}); use ddp or fsdp")
    if device == "cpu" and strategy == "dp":
        _needs_gpu(cfg, source, "distributed.strategy",
                   "dp (DataParallel) needs GPUs, but device is cpu; use single or ddp",
                   "distributed.strategy=dp needs GPUs and none is usable here; use single "
                   "or ddp on CPU")
    if device == "cpu" and cfg.memory.cpu_offload:
        _needs_gpu(cfg, source, "memory.cpu_offload",
                   "offloads from GPUs, but device is cpu; set it to false",
                   "memory.cpu_offload=true needs a GPU (torch cannot offload without an "
                   "accelerator); none is usable here")


def _needs_gpu(cfg: Config, source: str, key: str, contradiction: str, unavailable: str):
    """A GPU-only setting on the CPU: bad input (2) when the config itself says
    device=cpu, otherwise valid input this machine cannot run (3)."""
    if cfg.device == "cpu":
        raise ConfigError(source, key, contradiction)
    raise CannotRunHere(unavailable)


def world_sizes(cfg: Config, nodes: Nodes, nproc: int) -> tuple[int, ...]:
    if cfg.distributed.strategy in ("single", "dp"):
        return (1,)
    return tuple(n * nproc for n in range(nodes.min, nodes.max + 1))


# -------------------------------------------------------------------------- env, argv

class _Env:
    """The variables a plan sets; user-set values of the overridable ones win."""

    def __init__(self, environ: Environ) -> None:
        self.values: dict[str, str] = {}
        self.kept: list[str] = []
        self.user = environ.user_set

    def default(self, name: str, value: str) -> None:
        if name in self.user:
            if self.user[name] != value:
                self.kept.append(f"{name}={self.user[name]} (set by you; the launcher would "
                                 f"set {value})")
            return
        self.values[name] = value

    def force(self, name: str, value: str) -> None:
        self.values[name] = value


def build_env(cfg: Config, hw: Hardware, device: str, backend: str, nproc: int, nodes: Nodes,
              environ: Environ, app_root: str, direct: bool, master_port: int,
              max_restarts: int) -> tuple[dict[str, str], list[str]]:
    e = _Env(environ)
    # The node's variable wins over the config: interfaces can differ between nodes.
    ifname = environ.train_socket_ifname or cfg.distributed.socket_ifname
    debug = environ.train_debug or cfg.distributed.debug
    path = environ.user_set.get("PYTHONPATH", "")
    if app_root not in path.split(":"):  # workers run `-m launcher.worker` from any cwd
        e.force("PYTHONPATH", app_root + (":" + path if path else ""))
    e.force("PYTHONUNBUFFERED", "1")
    e.force("PYTHONFAULTHANDLER", "1")  # a crashing worker prints every thread's stack
    e.default("OMP_NUM_THREADS", str(max(1, hw.cpus // nproc)))
    if hw.vendor == "nvidia":
        e.default("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA numbers GPUs like NVML does
    if cfg.deterministic and device == "gpu":
        e.default("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if backend == "nccl":
        flight = str(cfg.run_dir / "nccl-flight-recorder-rank-")
        e.default("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        e.default("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")    # flight recorder on
        e.default("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")         # a timeout dumps it per rank
        e.default("TORCH_FR_DUMP_TEMP_FILE", flight)
        e.default("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", flight)  # the same, older torch
        e.default("NCCL_DEBUG", "INFO" if debug else "WARN")
    if ifname:
        e.default("NCCL_SOCKET_IFNAME", ifname)
        e.default("GLOO_SOCKET_IFNAME", ifname)
    if debug:
        e.default("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    for name, value in nodes.env.items():
        e.default(name, value)
    if direct:  # what torchrun would give a single worker, so stray variables cannot leak in
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("GROUP_RANK", "0"),
                            ("ROLE_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                            ("GROUP_WORLD_SIZE", "1"), ("ROLE_WORLD_SIZE", "1"),
                            ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(master_port)),
                            ("TORCHELASTIC_MAX_RESTARTS", str(max_restarts))):
            e.force(name, value)
    return e.values, e.kept


def plan(cfg: Config, hw: Hardware, tb: TorchBuild, environ: Environ, *, config_path: str,
         overrides: list[str], python: str, app_root: str, master_port: int = 29500) -> Plan:
    """Decide everything about the launch; raise ConfigError (2) or CannotRunHere (3)."""
    source = str(config_path)
    notes: list[str] = []
    device = resolve_device(cfg, hw, tb, environ.visibility.hsa_override_gfx_version, notes)
    backend = resolve_backend(cfg, device, tb, source)
    nodes = resolve_nodes(environ)
    notes.extend(nodes.notes)
    check_strategy(cfg, device, nodes, source)
    nproc = resolve_nproc(cfg, hw, device, nodes, source, notes)
    sizes = world_sizes(cfg, nodes, nproc)
    for size in sizes:
        try:
            batch_split(cfg, size)
        except ConfigError as exc:
            if nodes.max == nodes.min:
                raise
            raise ConfigError(exc.source, exc.key, f"{exc.problem} (at {size // nproc} of "
                              f"{nodes.min}:{nodes.max} nodes x {nproc} process(es); every "
                              "world size in the range must divide it)") from None
    max_restarts = cfg.distributed.max_restarts if nodes.max_restarts is None \
        else nodes.max_restarts
    direct = nodes.convention == "single" and nproc == 1
    env, kept = build_env(cfg, hw, device, backend, nproc, nodes, environ, app_root, direct,
                          master_port, max_restarts)
    worker = [WORKER_MODULE, source, *overrides, f"device={device}",
              f"distributed.backend={backend}"]
    log_dir = None
    if direct:
        argv = [python, "-m", *worker]
    else:
        log_dir = str(cfg.run_dir / "logs")
        argv = [python, "-m", "torch.distributed.run", *nodes.args, "--nproc-per-node",
                str(nproc), "--max-restarts", str(max_restarts), "--log-dir", log_dir,
                "--tee", "3", "-m", *worker]
    warnings = list(hw.warnings) + [f"kept {k}" for k in kept]
    if device == "gpu" and backend == "gloo":
        warnings.append("distributed.backend=gloo on GPUs is much slower than nccl")
    return Plan(mode="direct" if direct else "torchrun", argv=tuple(argv), env=env,
                device=device, backend=backend, nproc_per_node=nproc,
                nnodes=(nodes.min, nodes.max), world_sizes=sizes, max_restarts=max_restarts,
                convention=nodes.convention, rdzv_host=nodes.host, log_dir=log_dir,
                notes=tuple(notes), warnings=tuple(warnings))
