"""The worker's view of its process: environment, CPUs, device, process group.

All environment variables the worker reads are read here, once (torchrun's RANK,
WORLD_SIZE, LOCAL_RANK, ...; the image's build-manifest path). Everything else gets
plain values from :class:`WorkerEnv`.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from train.config import AUTO, Config
from train.errors import CannotRunHere

log = logging.getLogger("train")


@dataclass(frozen=True)
class WorkerEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_world_size: int | None = None  # torchrun: nodes in this rendezvous round
    restart_count: int = 0
    run_id: str | None = None
    build_manifest: str = "/app/build-manifest.json"
    code_version: str | None = None

    @classmethod
    def from_environ(cls, env: dict[str, str] | None = None) -> "WorkerEnv":
        env = os.environ if env is None else env

        def num(name: str, default: int | None) -> int | None:
            return int(env[name]) if env.get(name, "").strip() else default

        return cls(rank=num("RANK", 0), local_rank=num("LOCAL_RANK", 0),
                   world_size=num("WORLD_SIZE", 1), local_world_size=num("LOCAL_WORLD_SIZE", 1),
                   group_world_size=num("GROUP_WORLD_SIZE", None),
                   restart_count=num("TORCHELASTIC_RESTART_COUNT", 0),
                   run_id=env.get("TORCHELASTIC_RUN_ID"),
                   build_manifest=env.get("TRAIN_BUILD_MANIFEST", "/app/build-manifest.json"),
                   code_version=env.get("TRAIN_CODE_VERSION"))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

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


def available_cpus() -> int:
    """CPUs this process may use: affinity mask, capped by the cgroup CPU quota.

    os.cpu_count() reports the host's cores, which oversubscribes a container
    limited to a few CPUs (a classic slowdown).
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus or 1)


def _cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    try:
        text = (root / "cpu.max").read_text().split()  # cgroup v2: "max 100000" or "200000 100000"
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v1
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 else None
    except (OSError, ValueError):
        return None


def cpus_per_rank(env: WorkerEnv) -> int:
    return max(1, available_cpus() // env.local_world_size)


def resolve_device(cfg: Config, env: WorkerEnv) -> torch.device:
    want_gpu = cfg.device == "gpu" or (cfg.device == AUTO and torch.cuda.is_available())
    if not want_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():  # CUDA and ROCm builds both answer here
        raise CannotRunHere("device=gpu but this torch build sees no GPU; use device=cpu or "
                            "the CUDA/ROCm image with --gpus all (or /dev/kfd, /dev/dri)")
    index = env.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def resolve_backend(cfg: Config, device: torch.device) -> str:
    if cfg.distributed.backend != AUTO:
        return cfg.distributed.backend
    return "nccl" if device.type == "cuda" else "gloo"


def seed_everything(seed: int, rank: int) -> None:
    """Same model init on every rank (seed); per-rank streams for dropout (seed + rank)."""
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed)


def set_deterministic(enabled: bool) -> None:
    if enabled:
        # cuBLAS needs this before its first handle; the launcher sets it too.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled


def init_distributed(env: WorkerEnv, backend: str, device: torch.device, timeout_s: int,
                     *, single_process_group: bool = False) -> None:
    """Join the process group (torchrun's env://). single_process_group: a group of one,
    for FSDP on a single process (its CPU offload and mixed precision need a group)."""
    if not (env.distributed or single_process_group):
        return
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if not env.distributed:  # world size 1: an in-memory store, no address or port needed
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                            **kwargs)


def shutdown_distributed(clean: bool) -> None:
    """clean: every rank got here normally. The barrier keeps a fast rank from tearing
    down gloo while a peer is still finishing (seen here: an abort, "terminate called
    without an active exception", in about 1 of 4 two-process runs without it)."""
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def configure_logging(rank: int) -> None:
    """Every log line carries its rank, so interleaved logs of many ranks stay readable."""
    logging.basicConfig(level=logging.INFO, force=True,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
