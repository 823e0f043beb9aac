"""A plain DDP training script of your own, run under the launcher:

    python entrypoint.py launch distributed.nproc_per_node=2 \
        examples/ddp_script/train_ddp.py --steps 200

The launcher detects GPUs, picks the backend, starts one process per GPU (two here),
handles the cluster conventions, forwards signals and maps exit codes; the script only
asks ``runtime.init()`` for its device and process group (or reads torchrun's
RANK/WORLD_SIZE and TRAIN_DEVICE/TRAIN_BACKEND itself). It stops cleanly on SIGTERM:
every rank finishes its step, rank 0 saves, and the script exits 143.
"""

import argparse
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from train import runtime

stop = False


def on_signal(signum, frame):
    global stop
    stop = True


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="ddp-script-model.pt")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, on_signal)
    ctx = runtime.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)).to(ctx.device)
    if ctx.world_size > 1:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(ctx.rank)
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 16, generator=g).to(ctx.device)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ctx.is_main and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        flag = torch.tensor([float(stop)], device=ctx.device)
        if ctx.world_size > 1:  # every rank stops at the same step
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            break
    if ctx.is_main:
        torch.save((model.module if ctx.world_size > 1 else model).state_dict(), args.out)
        print(f"saved {args.out} at step {step}", flush=True)
    if ctx.world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 143 if stop else 0


if __name__ == "__main__":
    sys.exit(main())
