"""The reference for bench/ddp_overhead.py: a plain hand-written DDP loop.

Same model, data, optimizer and global batch as the trainer would build from the
config, none of its machinery (no sampler, loader, metrics, checkpoints, stop flag), and
no DDP wrapper on one process (the trainer has none there either). On a GPU (``device``
not cpu): nccl. bf16 autocast when ``precision: bf16`` and ``torch.compile`` when
``compile: true``, on any device (also the reference of bench/throughput.py and
bench/defaults.py).
Run under torchrun; rank 0 says when the first step is done, and prints the mean step
time of the timed steps as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from train.core.config import load_config
from train.data.builders import build_data
from train.models import build_model
from train.models.optim import build_optimizer


def main(config: str, warmup: int, *overrides: str) -> None:
    cfg = load_config(config, list(overrides))
    gpu = torch.cuda.is_available() and cfg.device != "cpu"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(cfg.seed)
    data = build_data(cfg)
    net = build_model(cfg.model, input_shape=data.input_shape,
                      num_classes=data.num_classes).to(device)
    model = DDP(net, device_ids=[local] if gpu else None) if world > 1 else net
    opt = build_optimizer(model, cfg.optim)  # the same optimizer and parameter groups
    forward = torch.compile(model) if cfg.compile else model
    autocast = torch.autocast(device.type, torch.bfloat16,
                              enabled=cfg.precision == "bf16")
    per_rank = cfg.train.global_batch_size // world
    n = len(data.train)
    times = []
    if rank == 0:
        print("plain: ready", flush=True)  # bench/startup.py: the workers' start ends here
    for step in range(cfg.train.max_steps):
        start = time.perf_counter()
        first = (step * cfg.train.global_batch_size + rank * per_rank) % (n - per_rank)
        x, y = data.train.__getitems__(list(range(first, first + per_rank)))
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast:
            loss = F.cross_entropy(forward(x).flatten(0, -2).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        if step == 0 and rank == 0:
            print("plain: step 1 done", flush=True)  # bench/startup.py waits for this line
    if rank == 0:
        timed = times[warmup:]
        peak = torch.cuda.max_memory_allocated(device) if gpu else None
        print(json.dumps({"step_time_s": sum(timed) / len(timed), "gpu_peak_bytes": peak}))
    # tearing down gloo while a peer still runs can abort (see train/distributed/ranks.py)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
