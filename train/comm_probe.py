"""One process of ``doctor --comm``: join a process group, run the preflight check's
matmul and all-reduce (:func:`train.guards.preflight.measure`, as training does before
step 1 of a multi-node run), say how far it got.

``python -m train.comm_probe --device gpu|cpu --backend nccl|gloo|mpi --timeout S``,
started by :mod:`launcher.commands.comm` with torchrun's variables set by hand. Each stage it
reaches (start, init, matmul, allreduce, done, or error) is written as a report
(:mod:`train.core.run.protocol`), with the measurements at the end, so the parent can name
the rank that hung and where, and judge the ranks as training would
(:func:`train.core.nodes.verdict.judge`).
"""

from __future__ import annotations

import argparse
import sys

from train.core.machine.host import exit_now
from train.core.run.protocol import COMM, Probe, Reporter

STAGES = ("start", "init", "matmul", "allreduce", "done")


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

        from train.distributed.stores import bind_store_servers
        from train.guards import preflight
        device = torch.device("cpu")
        kwargs = {}
        if args.device == "gpu":
            device = torch.device("cuda", ident.local_rank)
            torch.cuda.set_device(device)
            kwargs["device_id"] = device
        reporter.stage("init")
        bind_store_servers()
        dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout),
                                **kwargs)
        torch.set_num_threads(ident.threads_per_rank())  # as a training rank runs
        world = dist.get_world_size()
        r = preflight.measure(ident, device, stage=lambda name: reporter.stage(
            name, probe=Probe(world_size=world)))
        nbytes, seconds = r.allreduce_bytes, r.allreduce_ms / 1000
        busbw = nbytes * 2 * (world - 1) / world / seconds / 1e9 if world > 1 else None
        probe = Probe(world_size=world, ok=r.allreduce_ok, seconds=seconds, bytes=nbytes,
                      bus_gb_s=busbw, gflops=r.gflops, nonfinite=r.nonfinite, host=r.host,
                      node=r.node, check_s=r.seconds)
        reporter.stage("error" if r.error else "done", error=r.error, probe=probe)
        dist.destroy_process_group()
        return 0 if r.allreduce_ok and not r.error and not r.nonfinite else 1
    except Exception as exc:  # whatever failed is the probe's answer to the launcher
        reporter.stage("error", error=f"{type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    exit_now(child(sys.argv[1:]))  # no teardown of gloo threads (train/script.py says why)
