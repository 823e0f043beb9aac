"""Every environment variable the launcher reads, read here and nowhere else.

Three launch conventions arrive through the environment, besides a plain single
node:

- torchrun's own ``PET_<FLAG>`` variables (also what Kubeflow's elastic PyTorchJob
  sets): ``PET_NNODES=1:4``, ``PET_RDZV_ENDPOINT``, ``PET_RDZV_ID``, ...
- Kubeflow PyTorchJob v1 (non-elastic): ``MASTER_ADDR``, ``MASTER_PORT``,
  ``WORLD_SIZE`` (= number of pods, not processes) and ``RANK`` (= pod index).
- A Kubernetes Indexed Job from this project's k8s/ manifests:
  ``JOB_COMPLETION_INDEX`` plus ``TRAIN_RDZV_ENDPOINT`` (the standalone rendezvous
  Service), ``TRAIN_NNODES`` (``N`` or ``MIN:MAX``) and ``TRAIN_RDZV_ID`` (the Job's uid).

:func:`read` turns a mapping (``os.environ`` by default) into a frozen
:class:`Environ`; everything else receives plain values. Malformed values raise
:class:`~train.errors.ConfigError` naming the variable (exit 2).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

# torchrun flags that may come from PET_* variables and that the plan understands.
PET_FLAGS = ("NNODES", "NPROC_PER_NODE", "RDZV_BACKEND", "RDZV_ENDPOINT", "RDZV_ID",
             "RDZV_CONF", "MAX_RESTARTS", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
             "LOCAL_ADDR", "STANDALONE", "MONITOR_INTERVAL", "START_METHOD", "ROLE",
             "LOG_DIR", "REDIRECTS", "TEE")

DEFAULT_BUILD_MANIFEST = "/app/build-manifest.json"
DEFAULT_DNS_WAIT_S = 300.0


def _error(name: str, problem: str) -> Exception:
    from train.errors import ConfigError  # torch-free, but keep --help import-light
    return ConfigError("environment", name, problem)


@dataclass(frozen=True)
class Visibility:
    """Device visibility variables as found (None = unset, "" = set but empty)."""
    cuda_visible_devices: str | None = None
    nvidia_visible_devices: str | None = None
    rocr_visible_devices: str | None = None
    hip_visible_devices: str | None = None
    hsa_override_gfx_version: str | None = None
    cuda_device_order: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices,
                "NVIDIA_VISIBLE_DEVICES": self.nvidia_visible_devices,
                "ROCR_VISIBLE_DEVICES": self.rocr_visible_devices,
                "HIP_VISIBLE_DEVICES": self.hip_visible_devices,
                "HSA_OVERRIDE_GFX_VERSION": self.hsa_override_gfx_version,
                "CUDA_DEVICE_ORDER": self.cuda_device_order}


@dataclass(frozen=True)
class Environ:
    """What the environment says, already split into meaningful pieces."""
    raw: Mapping[str, str] = field(default_factory=dict, repr=False)
    pet: Mapping[str, str] = field(default_factory=dict)          # FLAG -> value (PET_ stripped)
    kubeflow: Mapping[str, str] = field(default_factory=dict)     # MASTER_ADDR/PORT, WORLD_SIZE, RANK
    job_completion_index: int | None = None
    train_nnodes: str | None = None
    train_rdzv_endpoint: str | None = None
    train_rdzv_id: str | None = None
    train_local_addr: str | None = None
    train_socket_ifname: str | None = None
    train_debug: bool = False
    inside_torchrun: bool = False
    visibility: Visibility = field(default_factory=Visibility)
    user_set: Mapping[str, str] = field(default_factory=dict)     # variables the plan must not override
    path: str = ""
    build_manifest: str = DEFAULT_BUILD_MANIFEST
    hw_root: str = "/"
    dns_wait_s: float = DEFAULT_DNS_WAIT_S

    @property
    def convention(self) -> str:
        """single | torchrun-env | kubeflow-v1 | indexed-job."""
        if self.pet.get("NNODES") or self.pet.get("RDZV_ENDPOINT"):
            return "torchrun-env"
        if self.job_completion_index is not None and self.train_rdzv_endpoint:
            return "indexed-job"
        if all(self.kubeflow.get(k) for k in ("MASTER_ADDR", "WORLD_SIZE", "RANK")) \
                and not self.inside_torchrun:
            return "kubeflow-v1"
        return "single"


# Variables the plan sets only when the user has not: their values win.
USER_OVERRIDABLE = ("OMP_NUM_THREADS", "CUDA_DEVICE_ORDER", "CUBLAS_WORKSPACE_CONFIG",
                    "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG",
                    "TORCH_DISTRIBUTED_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                    "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                    "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "PYTHONPATH")


def _opt(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    return value.strip() if value is not None and value.strip() else None


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = _opt(env, name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise _error(name, f"got {value!r}; expected a non-negative integer") from None
    if number < 0:
        raise _error(name, f"got {value!r}; expected a non-negative integer")
    return number


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    value = _opt(env, name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise _error(name, f"got {value!r}; expected a number of seconds") from None
    if number < 0:
        raise _error(name, f"got {value!r}; expected a number of seconds >= 0")
    return number


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = (_opt(env, name) or "0").lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise _error(name, f"got {value!r}; expected 1 or 0")


def read(env: Mapping[str, str] | None = None) -> Environ:
    """Read the environment once. ``env`` defaults to ``os.environ``."""
    env = dict(os.environ if env is None else env)
    pet = {flag: env[f"PET_{flag}"].strip() for flag in PET_FLAGS
           if env.get(f"PET_{flag}", "").strip()}
    kubeflow = {k: env[k].strip() for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
                if env.get(k, "").strip()}
    visibility = Visibility(
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        nvidia_visible_devices=env.get("NVIDIA_VISIBLE_DEVICES"),
        rocr_visible_devices=env.get("ROCR_VISIBLE_DEVICES"),
        hip_visible_devices=env.get("HIP_VISIBLE_DEVICES"),
        hsa_override_gfx_version=_opt(env, "HSA_OVERRIDE_GFX_VERSION"),
        cuda_device_order=_opt(env, "CUDA_DEVICE_ORDER"))
    return Environ(
        raw=env, pet=pet, kubeflow=kubeflow,
        job_completion_index=_int(env, "JOB_COMPLETION_INDEX"),
        train_nnodes=_opt(env, "TRAIN_NNODES"),
        train_rdzv_endpoint=_opt(env, "TRAIN_RDZV_ENDPOINT"),
        train_rdzv_id=_opt(env, "TRAIN_RDZV_ID"),
        train_local_addr=_opt(env, "TRAIN_LOCAL_ADDR"),
        train_socket_ifname=_opt(env, "TRAIN_SOCKET_IFNAME"),
        train_debug=_flag(env, "TRAIN_DEBUG"),
        inside_torchrun=bool(_opt(env, "TORCHELASTIC_RUN_ID")),
        visibility=visibility,
        user_set={k: env[k] for k in USER_OVERRIDABLE if env.get(k, "").strip()},
        path=env.get("PATH", os.defpath),
        build_manifest=_opt(env, "TRAIN_BUILD_MANIFEST") or DEFAULT_BUILD_MANIFEST,
        hw_root=_opt(env, "TRAIN_HW_ROOT") or "/",
        dns_wait_s=_float(env, "TRAIN_DNS_WAIT_S", DEFAULT_DNS_WAIT_S))


STATUS_DIR_VAR = "TRAIN_LAUNCHER_STATUS_DIR"


@dataclass(frozen=True)
class WorkerIdentity:
    """Inside a worker: where to report how it ended, and who it is."""
    status_dir: str | None
    rank: int
    local_rank: int
    restart: int
    log_dir: str | None      # torchrun's per-worker log folder (holds stdout.log/stderr.log)


def worker_identity(env: Mapping[str, str] | None = None) -> WorkerIdentity:
    env = os.environ if env is None else env

    def num(name: str) -> int:
        value = env.get(name, "").strip()
        return int(value) if value.isdigit() else 0

    error_file = _opt(env, "TORCHELASTIC_ERROR_FILE")
    log_dir = os.path.dirname(error_file) if error_file else None
    if log_dir and not os.path.isfile(os.path.join(log_dir, "stderr.log")):
        log_dir = None  # torchrun without --log-dir/--tee: the output went to the console
    return WorkerIdentity(status_dir=_opt(env, STATUS_DIR_VAR), rank=num("RANK"),
                          local_rank=num("LOCAL_RANK"), restart=num("TORCHELASTIC_RESTART_COUNT"),
                          log_dir=log_dir)
