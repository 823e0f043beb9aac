"""Checkpoint cost of the formats under FSDP: full (rank 0 gathers every tensor and
writes one file) against sharded (each rank writes its own shards), in the foreground
and in the background (DCP's async_save: training blocked only while the shards are
copied to CPU memory).

For each model size, one torchrun of 2 processes (gloo, CPU) per format builds the same
FSDP model of Linear layers with its Adam state, saves a checkpoint with the trainer's
own functions (train.distributed.parallel.full_state + one fsync'ed file, or
train.checkpoint.sharded) and loads it back into a fresh model. Printed per size, with
ratios against full: seconds a save blocks its caller, save and load seconds (the
slowest rank), and each rank's peak RSS during the save and during the load above its
RSS when that began. What rank 0 must hold in the full format grows with the whole
model; in a sharded save with its own part.

    python -m bench.checkpoint [--widths 1448,2896] [--layers 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("full", "sharded", "sharded-async")


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


def _save(fmt: str, model, optimizer, folder: Path, rank: int) -> float:
    """Save; return how long the caller was blocked (training would wait that long)."""
    from train.checkpoint import sharded
    from train.checkpoint.serializer import save_file
    from train.distributed.parallel import full_state
    start = time.perf_counter()
    if fmt == "sharded-async":
        finish = sharded.save_in_background(sharded.state_dicts(model, optimizer), folder)
        blocked = time.perf_counter() - start
        finish()
        return blocked
    if fmt == "sharded":
        sharded.save(sharded.state_dicts(model, optimizer), folder)
    else:
        model_state, optim_state = full_state(model, optimizer)
        if rank == 0:
            save_file({"model": model_state, "optimizer": optim_state}, folder / "state.pt")
    return time.perf_counter() - start


def _load(fmt: str, model, optimizer, folder: Path) -> None:
    import torch

    from train.checkpoint import sharded
    from train.distributed.parallel import load_full_state
    if fmt.startswith("sharded"):
        sharded.load(model, optimizer, folder)
        return
    saved = torch.load(folder / "state.pt", weights_only=True)
    load_full_state(model, optimizer, saved["model"], saved["optimizer"])


def worker(fmt: str, width: int, layers: int, folder: Path) -> None:
    """One rank under torchrun: prints one JSON line (rank 0 gathers every rank's)."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = _build(width, layers)
    if fmt == "sharded-async":
        from train.checkpoint import sharded
        sharded.writer_group()  # made once per process, at the first background save
    dist.barrier()
    rss, start = _phase_start(), time.perf_counter()
    blocked = _save(fmt, model, optimizer, folder, rank)
    dist.barrier()
    saved, save_peak = time.perf_counter() - start, _peak_above(rss)
    del model, optimizer
    gc.collect()
    model, optimizer = _build(width, layers)
    dist.barrier()
    rss, start = _phase_start(), time.perf_counter()
    _load(fmt, model, optimizer, folder)
    dist.barrier()
    row = {"rank": rank, "save_blocking_s": blocked, "save_s": saved,
           "load_s": time.perf_counter() - start,
           "save_peak_mib": save_peak, "load_peak_mib": _peak_above(rss)}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(json.dumps(rows), flush=True)
    dist.destroy_process_group()


def measure(fmt: str, width: int, layers: int, workdir: Path) -> list[dict]:
    folder = Path(tempfile.mkdtemp(dir=workdir))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           __file__, "--worker", fmt, str(width), str(layers), str(folder)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"benchmark run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(runs: list[list[dict]]) -> dict:
    """Medians over rounds of the slowest rank's times and of each rank's peak."""
    out = {key: statistics.median(max(r[key] for r in run) for run in runs)
           for key in ("save_blocking_s", "save_s", "load_s")}
    for rank in range(len(runs[0])):
        for key in ("save_peak_mib", "load_peak_mib"):
            out[f"{key}_rank{rank}"] = statistics.median(run[rank][key] for run in runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1448,2896")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for width in (int(w) for w in args.widths.split(",")):
            params = args.layers * (width * width + width)
            result: dict[str, list] = {fmt: [] for fmt in FORMATS}
            for _ in range(args.rounds):  # alternating: machine noise hits all alike
                for fmt in FORMATS:
                    result[fmt].append(measure(fmt, width, args.layers, Path(tmp)))
            rows = {fmt: summarize(runs) for fmt, runs in result.items()}
            print(f"{params / 1e6:.1f} M parameters ({params * 12 / 2**20:.0f} MiB with Adam), "
                  f"2 processes; ratios against full:")
            for key in rows["full"]:
                ref = rows["full"][key]
                cells = [f"{fmt} {rows[fmt][key]:8.2f}" + (
                    f" ({rows[fmt][key] / ref:.2f})" if fmt != "full" and ref > 0.01 else "")
                    for fmt in FORMATS]
                print(f"  {key:20s} " + "  ".join(cells))


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
    else:
        main()
