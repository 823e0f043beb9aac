"""Checkpoint cost against the disk: how fast the trainer's saves write, next to a plain
durable write of the same bytes measured in the same process right after.

Formats, under FSDP (one torchrun of 2 processes, gloo, CPU, per format and round):
full (rank 0 gathers every tensor and writes one file) and sharded (each rank writes its
own shards), the latter also in the background (DCP's async_save: training blocked only
while the shards are copied to CPU memory; the second background save is the one
reported, the first one of a process also allocates the copy). Each save goes through
the trainer's own Checkpointer (every file hashed and fsync'ed, checksums.json, the
folder renamed into place, ``latest`` replaced) with the model and Adam state of a stack
of Linear layers.

The reference: every rank writes as many bytes as it wrote for the save into one file,
durably (fsync), at the same time as the other rank, twice: through the page cache in
64 MiB writes, and with O_DIRECT in 8 MiB writes. The faster one is "the disk's"
bandwidth; a save's bandwidth is the checkpoint's bytes over the time from the save call
to the sealed checkpoint (the full format's gather onto rank 0 is printed apart, as
"collect"). Ratios are taken per round, then the median over rounds. CPU seconds per
save (the busiest rank's process, every thread) are printed beside the plain write's and
those of SHA-256 over the same bytes alone: they hold at any load, where the times do not.

First the small job (bench/small_checkpoint.py, which also runs alone): the quick
start's model with its AdamW state, one process, its first and later saves and its
resume against plain ``torch.save`` + fsync and ``torch.load`` + SHA-256.

    python -m bench.checkpoint [--widths 1448,2896] [--layers 8] [--rounds 2]
                               [--small-rounds 5] [--dir DIR] [--remote]

``--remote`` then measures the remote tier (``checkpoint.remote``) against plain boto3
on a real S3 server: bench/remote_checkpoint.py, which also runs alone.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("full", "sharded")
MiB = 1 << 20
MB = 1e6   # bandwidths in MB/s, as dd prints them


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _phase_start() -> float:
    """Reset this process's peak RSS (Linux: clear_refs 5) and return the RSS now."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def _peak_above(start: float) -> float:
    return _status_mib("VmHWM") - start


# ------------------------------------------------------------- the plain durable write

def plain_write(path: Path, size: int, direct: bool) -> float:
    """Seconds to write ``size`` bytes into a new file and fsync it: 64 MiB writes
    through the page cache, or 8 MiB O_DIRECT writes (the unaligned tail through the
    page cache)."""
    chunk = 8 * MiB if direct else 64 * MiB
    block = mmap.mmap(-1, chunk)
    block.write(os.urandom(MiB) * (chunk // MiB))
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0))
    try:
        done = 0
        while size - done >= chunk or (not direct and done < size):
            done += os.write(fd, memoryview(block)[:min(chunk, size - done)])
        if done < size:
            os.close(fd)
            fd = os.open(path, os.O_WRONLY)
            os.pwrite(fd, memoryview(block)[:size - done], done)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


# ------------------------------------------------------------------- FSDP, 2 ranks

def _build(width: int, layers: int):
    import torch
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()  # Adam's moments exist: the state a checkpoint carries
    return model, optimizer


def _checkpointer(run_dir: Path):
    import torch.distributed as dist

    from train.checkpoint import Checkpointer

    def gather(value):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out
    return Checkpointer(run_dir, rank=dist.get_rank(), keep_last=3,
                        world_size=dist.get_world_size(), barrier=dist.barrier, gather=gather)


def _save(fmt: str, ckpt, model, optimizer, step: int, background: bool) -> dict:
    """One save as the trainer makes it; seconds collecting, blocked, until sealed."""
    import torch.distributed as dist

    from train.checkpoint import formats
    from train.checkpoint.state import rank_payload
    dist.barrier()
    start = time.perf_counter()
    model_state, optim_state, shards = formats.FORMATS[fmt].collect(model, optimizer,
                                                                    background)
    collected, cpu = time.perf_counter(), time.process_time()
    shared = {"step": step, "model": model_state, "optimizer": optim_state, "format": fmt}
    ckpt.save(step, shared, rank_payload(dist.get_rank()), background=background,
              shards=shards)
    blocked = time.perf_counter()
    ckpt.wait()
    dist.barrier()  # sealed by rank 0
    end = time.perf_counter()
    return {"collect_s": collected - start, "blocking_s": blocked - start,
            "save_s": end - collected, "cpu_s": time.process_time() - cpu}


def _rank_bytes(folder: Path, rank: int) -> int:
    """The bytes rank ``rank`` wrote into a sealed checkpoint folder."""
    mine = [f"rank-{rank}.pt", f"model/__{rank}_0.distcp", f"model/__{rank}_1.distcp"]
    if rank == 0:
        mine += ["state.pt", "model/.metadata", "checksums.json"]
    return sum((folder / name).stat().st_size for name in mine if (folder / name).exists())


def _reference(folder: Path, size: int) -> dict:
    """Both plain durable writes of ``size`` bytes, every rank at once."""
    import torch.distributed as dist
    out = {}
    for kind, direct in (("buffered", False), ("direct", True)):
        dist.barrier()
        cpu = time.process_time()
        out[f"{kind}_s"] = plain_write(folder / f"plain-{dist.get_rank()}", size, direct)
        out[f"{kind}_cpu_s"] = time.process_time() - cpu
    return out


def sha256_cpu(size: int) -> float:
    """CPU seconds for SHA-256 over ``size`` bytes in memory: a save's floor, since every
    file is hashed, one stream per file."""
    block, cpu = os.urandom(MiB) * 64, time.process_time()
    digest = hashlib.sha256()
    for start in range(0, size, len(block)):
        digest.update(memoryview(block)[:size - start])
    return time.process_time() - cpu


def worker(fmt: str, width: int, layers: int, run_dir: Path) -> None:
    """One rank under torchrun: prints one JSON line (rank 0 gathers every rank's)."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = _build(width, layers)
    ckpt = _checkpointer(run_dir)
    row: dict = {"rank": rank}
    rss = _phase_start()
    row["sync"] = _save(fmt, ckpt, model, optimizer, 1, background=False)
    row["save_peak_mib"] = _peak_above(rss)
    folder = run_dir / "checkpoints" / "step-1"
    row["bytes"] = _rank_bytes(folder, rank)
    row["ref"] = _reference(run_dir, row["bytes"])
    row["sha256_cpu_s"] = sha256_cpu(row["bytes"])
    if fmt == "sharded":
        from train.checkpoint import sharded
        sharded.writer_group()  # made once per process, at the first background save
        row["async_first"] = _save(fmt, ckpt, model, optimizer, 2, background=True)
        row["async"] = _save(fmt, ckpt, model, optimizer, 3, background=True)
    del model, optimizer
    gc.collect()
    model, optimizer = _build(width, layers)
    dist.barrier()
    rss, start = _phase_start(), time.perf_counter()
    _load(fmt, model, optimizer, folder)
    dist.barrier()
    row["load_s"], row["load_peak_mib"] = time.perf_counter() - start, _peak_above(rss)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(json.dumps(rows), flush=True)
    dist.destroy_process_group()


def _load(fmt: str, model, optimizer, folder: Path) -> None:
    import torch

    from train.checkpoint import sharded
    from train.distributed.parallel import load_full_state
    if fmt == "sharded":
        sharded.load(model, optimizer, folder / "model")
        return
    saved = torch.load(folder / "state.pt", weights_only=True)
    load_full_state(model, optimizer, saved["model"], saved["optimizer"])


def measure(fmt: str, width: int, layers: int, workdir: Path) -> list[dict]:
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           __file__, "--worker", fmt, str(width), str(layers), str(run_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    subprocess.run(["rm", "-rf", str(run_dir)], check=False)
    if proc.returncode != 0:
        sys.exit(f"benchmark run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def figures(run: list[dict]) -> dict:
    """One round's figures: the slowest rank's times, bandwidths over every rank's bytes."""
    total = sum(r["bytes"] for r in run) / MB
    slowest = {key: max(r["sync"][key] for r in run) for key in run[0]["sync"]}
    ref = {kind: total / max(r["ref"][f"{kind}_s"] for r in run)
           for kind in ("buffered", "direct")}
    out = {"MB": total, "collect_s": slowest["collect_s"], "save_s": slowest["save_s"],
           "save_MBps": total / slowest["save_s"], "buffered_MBps": ref["buffered"],
           "direct_MBps": ref["direct"], "disk_MBps": max(ref.values()),
           "load_s": max(r["load_s"] for r in run),
           "save_cpu_s": slowest["cpu_s"],  # the busiest rank's
           "plain_cpu_s": max(r["ref"]["direct_cpu_s"] for r in run),
           "sha256_cpu_s": max(r["sha256_cpu_s"] for r in run)}
    out["ratio"] = out["save_MBps"] / out["disk_MBps"]
    if "async" in run[0]:
        sync_blocking = slowest["blocking_s"]
        out["async_blocking_s"] = max(r["async"]["blocking_s"] for r in run)
        out["async_first_blocking_s"] = max(r["async_first"]["blocking_s"] for r in run)
        out["sync_blocking_s"] = sync_blocking
        out["async_ratio"] = out["async_blocking_s"] / sync_blocking
    for r in run:
        out[f"save_peak_mib_rank{r['rank']}"] = r["save_peak_mib"]
        out[f"load_peak_mib_rank{r['rank']}"] = r["load_peak_mib"]
    return out


def median_figures(rounds: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def report_fsdp(width: int, layers: int, rows: dict[str, dict]) -> None:
    params = layers * (width * width + width)
    print(f"{params / 1e6:.1f} M parameters ({params * 12 / MiB:.0f} MiB with Adam), "
          "2 processes (medians over rounds; ratio: per round, then the median):")
    for key in rows["full"]:
        cells = [f"{fmt} {rows[fmt][key]:9.2f}" for fmt in FORMATS if key in rows[fmt]]
        print(f"  {key:22s} " + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1448,2896")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--small-rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary "
                        "folder under $TMPDIR): the disk measured")
    parser.add_argument("--remote", action="store_true", help="then the remote tier "
                        "(checkpoint.remote) against plain boto3 on a SeaweedFS server: "
                        "bench.remote_checkpoint with its defaults; needs `make s3`")
    args = parser.parse_args()
    from bench import small_checkpoint
    if args.remote:  # fail before the long local part, not after it
        from bench import remote_checkpoint
        from tests.harness import s3server
        if s3server.missing():
            raise SystemExit(f"bench.checkpoint --remote: {s3server.missing()}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        small_checkpoint.report(args.small_rounds, 10, Path(tmp))
        last: dict[str, dict] = {}
        for width in (int(w) for w in args.widths.split(",")):
            result: dict[str, list] = {fmt: [] for fmt in FORMATS}
            for _ in range(args.rounds):  # alternating: machine noise hits all alike
                for fmt in FORMATS:
                    result[fmt].append(figures(measure(fmt, width, args.layers, Path(tmp))))
            last = {fmt: median_figures(rounds) for fmt, rounds in result.items()}
            report_fsdp(width, args.layers, last)
    s = last["sharded"]
    print(f"async save blocks {s['async_blocking_s']:.2f} s = {s['async_ratio']:.2f} of a "
          f"synchronous one's {s['sync_blocking_s']:.2f} s (the first async save of a "
          f"process {s['async_first_blocking_s']:.2f} s: it allocates the staging copy)")
    for fmt in FORMATS:
        row = last[fmt]
        print(f"{fmt} save CPU: {row['save_cpu_s']:.2f} s on the busiest rank, the plain "
              f"durable write's {row['plain_cpu_s']:.2f} s, SHA-256 of the same bytes alone "
              f"{row['sha256_cpu_s']:.2f} s")
    for fmt in FORMATS:
        row = last[fmt]
        print(f"{fmt} save bandwidth: {row['save_MBps']:.0f} MB/s = {row['ratio']:.2f} of "
              f"the disk's {row['disk_MBps']:.0f} MB/s")
    if args.remote:
        remote_checkpoint.report(256, 3)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
        # the trainer's workers end the same way: the teardown of gloo's C++ threads
        # aborted a rank now and then after its work was done (exit -6)
        from train.core.machine.host import exit_now
        exit_now(0)
    else:
        main()
