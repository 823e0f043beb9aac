"""One process of ``doctor --comm``: join a process group, all-reduce once, say how far
it got.

``python -m train.comm_probe --device gpu|cpu --backend nccl|gloo|mpi --timeout S``,
started by :mod:`launcher.comm` with torchrun's variables set by hand. Each stage it
reaches (start, init, all-reduce, done, or error) is written as a report
(:mod:`train.core.protocol`), so the parent can name the rank that hung and where.
"""

from __future__ import annotations

import argparse
import sys
import time

from train.core.protocol import COMM, Probe, Reporter

STAGES = ("start", "init", "allreduce", "done")
ELEMENTS = {"gpu": 16 * 1024 * 1024, "cpu": 256 * 1024}   # 64 MiB / 1 MiB of float32


def child(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.comm_probe")
    parser.add_argument("--device", choices=("gpu", "cpu"), required=True)
    parser.add_argument("--backend", choices=("nccl", "gloo", "mpi"), required=True)
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args(argv)
    reporter = Reporter.from_environ(COMM)
    ident = reporter.ident
    reporter.stage("start")
    try:
        import datetime

        import torch
        import torch.distributed as dist
        device = torch.device("cpu")
        kwargs = {}
        if args.device == "gpu":
            device = torch.device("cuda", ident.local_rank)
            torch.cuda.set_device(device)
            kwargs["device_id"] = device
        reporter.stage("init")
        dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout),
                                **kwargs)
        world = dist.get_world_size()
        x = torch.ones(ELEMENTS[args.device], device=device)
        reporter.stage("allreduce", probe=Probe(world_size=world))
        dist.all_reduce(x)  # warm-up (connects the ring)
        x.fill_(1.0)
        _sync(torch, device)
        start = time.perf_counter()
        dist.all_reduce(x)
        _sync(torch, device)
        seconds = time.perf_counter() - start
        ok = bool((x == world).all().item())
        nbytes = x.numel() * 4
        busbw = nbytes * 2 * (world - 1) / world / seconds / 1e9 if world > 1 else None
        reporter.stage("done", probe=Probe(world_size=world, ok=ok, seconds=seconds,
                                           bytes=nbytes, bus_gb_s=busbw))
        dist.destroy_process_group()
        return 0 if ok else 1
    except Exception as exc:
        reporter.stage("error", error=f"{type(exc).__name__}: {exc}")
        return 1


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(child(sys.argv[1:]))
