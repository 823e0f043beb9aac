"""The worker's process set-up: device, determinism, seeds, the process group, the few
collectives the trainer needs outside the model, logging.

What the process is (rank, world size, ...) comes from
:class:`~train.core.run.identity.WorkerIdentity`. The placement rules it applies are
:mod:`train.core.machine.placement`'s, shared with the launcher.
"""

from __future__ import annotations

import datetime
import logging
import random
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from train.core.config import AUTO, Config
from train.core.errors import EXIT_TRAINING_FAILED, CannotRunHere, UserError, printable
from train.core.machine import comm_defaults, placement
from train.core.run.identity import WorkerIdentity
from train.core.storage.credentials import redacted
from train.distributed.stores import bind_store_servers

log = logging.getLogger("train")


def resolve_device(cfg: Config, env: WorkerIdentity) -> torch.device:
    want_gpu = cfg.device == "gpu" or (cfg.device == AUTO and torch.cuda.is_available())
    if not want_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():  # CUDA and ROCm builds both answer here
        raise CannotRunHere("device=gpu but this torch build sees no GPU; use device=cpu or "
                            "the CUDA/ROCm image with --gpus all (or /dev/kfd, /dev/dri)")
    # replica groups on one machine: each group's ranks start at its own device
    index = (env.device_offset + env.local_rank) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def resolve_backend(cfg: Config, device: torch.device) -> str:
    backend = placement.resolve_backend(cfg.distributed.backend, device.type == "cuda")
    built = {"nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available(),
             "mpi": dist.is_mpi_available()} if dist.is_available() else {}
    problem = placement.backend_problem(backend, built, torch.__version__)
    if problem:
        raise CannotRunHere(problem)
    return backend


def apply_comm_env(cfg: Config, env: WorkerIdentity, device: torch.device, backend: str) -> None:
    """The communication variables the launcher would have set (a bare torchrun gets them
    too); the environment's values win. Before the process group and the first cuBLAS
    handle exist, which read them."""
    # vendor=None: CUDA_DEVICE_ORDER only matters before CUDA starts, which it already has
    # here; the launcher sets it for workers so that CUDA numbers GPUs as NVML does.
    added = comm_defaults.apply_defaults(comm_defaults.worker_defaults(
        gpu=device.type == "cuda", backend=backend, vendor=None,
        deterministic=cfg.deterministic,
        run_dir=cfg.run_dir, debug=env.debug or cfg.distributed.debug,
        socket_ifname=env.socket_ifname or cfg.distributed.socket_ifname))
    if added and env.is_main:
        log.info("set %s", " ".join(f"{k}={v}" for k, v in added.items()))


def seed_everything(seed: int, rank: int) -> None:
    """Same model init on every rank (seed); per-rank streams for dropout (seed + rank)."""
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed)


def set_deterministic(enabled: bool) -> None:
    """cuBLAS also needs CUBLAS_WORKSPACE_CONFIG, set by :func:`apply_comm_env`.

    torch.use_deterministic_algorithms imports torch._inductor (and torch._dynamo with
    it: 829 modules, about 0.9 CPU-s here) whatever its argument, to set inductor's own
    flag. So it is called only to change the flag: off, the default of both torch and
    inductor, costs nothing to keep. (torch 2.13's optimizers and DDP import the same
    modules at their first use, so today this moves the cost rather than saving it.)"""
    if enabled != torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled


def init_distributed(env: WorkerIdentity, backend: str, device: torch.device, timeout_s: int,
                     *, single_process_group: bool = False) -> None:
    """Join the process group (torchrun's env://). single_process_group: a group of one,
    for FSDP on a single process (its CPU offload and mixed precision need a group)."""
    if not (env.distributed or single_process_group):
        return
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if not env.distributed:  # world size 1: an in-memory store, no address or port needed
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    bind_store_servers()
    try:
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                **kwargs)
    except (dist.DistNetworkError, dist.DistStoreError) as exc:
        if not env.by_hand:  # torchrun's workers: the launcher words the ending
            raise
        raise PeersMissing(peers_missing(env, timeout_s, exc)) from None


class PeersMissing(UserError):
    """A worker started by hand whose peers never met it: one line, exit 1 (starting the
    others, or the job through the launcher, can help)."""

    exit_code = EXIT_TRAINING_FAILED


def peers_missing(env: WorkerIdentity, timeout_s: int, exc: Exception) -> str:
    where = f"MASTER_ADDR:MASTER_PORT={env.master_addr}:{env.master_port}"
    waited = (f"nothing answered at {where} (rank 0's) within distributed.timeout_s="
              f"{timeout_s} s" if env.rank else
              f"the other {env.world_size - 1} of WORLD_SIZE={env.world_size} processes did "
              f"not all reach {where} within distributed.timeout_s={timeout_s} s")
    said = str(exc).strip().splitlines()
    return (f"rank {env.rank}: {waited} ({type(exc).__name__}: {said[0] if said else ''}); "
            f"start every rank 0..{env.world_size - 1} with the same MASTER_ADDR and "
            "MASTER_PORT, or start the job with `entrypoint.py train` (or torchrun), which "
            "starts them all")


def barrier(env: WorkerIdentity) -> Callable[[], None]:
    return dist.barrier if env.distributed else (lambda: None)


def gather(env: WorkerIdentity) -> Callable[[object], list]:
    """Every rank's value of a small object, on every rank (alone: its own)."""
    def everyone(value: object) -> list:
        if not env.distributed:
            return [value]
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out
    return everyone


def from_main(value, env: WorkerIdentity):
    """Rank 0's value on every rank (decisions that must not differ between ranks)."""
    if not env.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_over_ranks(values: list[torch.Tensor | float], device: torch.device,
                      distributed: bool) -> list[list[float]]:
    """One all-gather for several scalars (loss, step time, phase times ...): every
    rank's values, in rank order, on every rank."""
    parts: list[torch.Tensor] = []
    floats: list[float] = []
    for value in values:  # a run of plain numbers becomes one tensor
        if isinstance(value, torch.Tensor):
            if floats:
                parts.append(torch.tensor(floats, dtype=torch.float32, device=device))
                floats = []
            parts.append(value.detach().reshape(1).to(torch.float32))
        else:
            floats.append(float(value))
    if floats:
        parts.append(torch.tensor(floats, dtype=torch.float32, device=device))
    mine = torch.cat(parts) if len(parts) > 1 else parts[0]
    if not distributed:
        return [mine.tolist()]
    everyone = mine.new_empty(dist.get_world_size() * mine.numel())
    _gather_into(everyone, mine)
    return everyone.view(-1, mine.numel()).tolist()


def _gather_into(everyone: torch.Tensor, mine: torch.Tensor) -> None:
    """torch's all-gather into one tensor under its current name (2.13 deprecates
    ``all_gather_into_tensor`` with a FutureWarning at every call; older torch has only
    that name)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(everyone, mine)


def mean_of(rows: list[list[float]], columns: int) -> list[float]:
    """The mean over ranks of the first ``columns`` values of each rank's row."""
    return [sum(row[i] for row in rows) / len(rows) for i in range(columns)]


# Process groups referenced until the process ends (see keep_until_exit).
_KEPT: list = []


def keep_until_exit() -> None:
    """Keep the default process group's object alive until the process ends (workers end
    with os._exit, so it is never destroyed). Its C++ destructor joins gloo's worker
    threads while the thread that dropped the last reference holds the GIL; a worker
    thread still releasing a finished collective's tensors waits for the GIL: a deadlock.
    Seen: a rank whose run failed right after a collective never exited, hung where the
    exception's traceback let go of DDP, whose reducer held the group's last reference."""
    if dist.is_available() and dist.is_initialized():
        _KEPT.append(dist.group.WORLD)


def shutdown_distributed(clean: bool) -> None:
    """clean: every rank got here normally. The barrier keeps a fast rank from tearing
    down gloo while a peer is still finishing (seen here: an abort, "terminate called
    without an active exception", in about 1 of 4 two-process runs without it)."""
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()
        keep_until_exit()
        dist.destroy_process_group()


class EscapingFormatter(logging.Formatter):
    """Messages with control characters escaped (a path or name from the config cannot
    act on the terminal or forge a line); tracebacks keep their lines. Credentials are
    hidden in both (:func:`~train.core.storage.credentials.redacted`)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return redacted(super().formatException(ei))


def configure_logging(rank: int) -> None:
    """Every log line carries its rank, so interleaved logs of many ranks stay readable."""
    logging.basicConfig(level=logging.INFO, force=True)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(EscapingFormatter(
            f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", datefmt="%H:%M:%S"))
