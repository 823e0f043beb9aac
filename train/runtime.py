"""The API for your own script under ``entrypoint.py launch`` (or plain torchrun):
set up the device and the process group the way the trainer does, and give your own
DataLoaders the trainer's handling of stop signals (docs/your-code.md).

    from train import runtime
    ctx = runtime.init()          # ctx.device, ctx.rank, ctx.world_size
    loader = DataLoader(..., worker_init_fn=runtime.loader_worker_init())

The worker's own machinery is :mod:`train.distributed.ranks`; this module is what user
code may rely on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from train.core.config import AUTO
from train.core.errors import CannotRunHere
from train.core.machine import placement
from train.core.run.identity import WorkerIdentity
from train.data.loader import loader_worker_init
from train.distributed.ranks import keep_until_exit
from train.distributed.stores import bind_store_servers

__all__ = ["Context", "init", "loader_worker_init"]


@dataclass(frozen=True)
class Context:
    """What ``init()`` set up for a script: its device, rank and process group."""
    device: torch.device
    rank: int
    local_rank: int
    world_size: int
    backend: str | None          # None: one process, no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init() -> Context:
    """For your own script under ``entrypoint.py launch`` (or plain torchrun): the device
    and process group the way the trainer sets them up.

        from train import runtime
        ctx = runtime.init()          # ctx.device, ctx.rank, ctx.world_size
        model = DDP(model.to(ctx.device)) if ctx.world_size > 1 else model.to(ctx.device)

    The device and backend are the launcher's choice (TRAIN_DEVICE, TRAIN_BACKEND), else
    a GPU when torch sees one; every rank of a multi-process run joins the group.
    """
    env = WorkerIdentity.from_environ()
    gpu = env.device == "gpu" if env.device else torch.cuda.is_available()
    device = torch.device("cpu")
    if gpu:
        if not torch.cuda.is_available():
            raise CannotRunHere("TRAIN_DEVICE=gpu but this torch build sees no GPU")
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    backend = None
    if env.distributed:
        backend = env.backend or placement.resolve_backend(AUTO, gpu)
        if not dist.is_initialized():
            kwargs = {"device_id": device} if gpu else {}
            bind_store_servers()
            dist.init_process_group(backend=backend, **kwargs)
            keep_until_exit()  # never torn down: train.script ends with os._exit
    return Context(device, env.rank, env.local_rank, env.world_size, backend)
