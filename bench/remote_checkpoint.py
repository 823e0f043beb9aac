"""The remote checkpoint tier (``checkpoint.remote``) against a plain boto3 client, on a
real S3 server (SeaweedFS on 127.0.0.1, started here: ``make s3``).

One checkpoint of ``--mib`` MiB (a random tensor in state.pt, written and sealed by the
trainer's own Checkpointer) is uploaded, in the same run, by:

- plain put: boto3's ``put_object`` of each file's bytes (read into memory first);
- plain managed transfer: boto3's ``upload_file`` (multipart, parallel parts) with its
  default settings;
- the tier's upload: the tier's own transfer of every file, without the read-back;
- the tier's mirror: what a run does after each save (upload, read back and hash every
  file, checksums.json, ``latest``, keep_last).

Printed: seconds and MiB/s for each, and each one's ratio to the plain put (the issue's
goal for the tier's upload: 0.8 of it at least). Then the training time a save blocks,
with and without the tier attached (a foreground save of the same state): the upload
runs in the background, so the ratio should be about 1.

    python -m bench.remote_checkpoint [--mib 256] [--rounds 3]
    python -m bench.checkpoint --remote       (after the local measurements)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from tests.harness import s3server


def _sealed(run_dir: Path, mib: int, remote=None) -> float:
    """Seconds a foreground save of ``mib`` MiB blocks (the tier's hook attached or not)."""
    import torch

    from train.checkpoint import Checkpointer
    store = Checkpointer(run_dir, rank=0, keep_last=2, tier=remote)
    state = {"model": {"w": torch.randn(mib << 18)}}  # 4-byte floats: mib MiB
    started = time.perf_counter()
    store.save(1, state, {"rng": torch.get_rng_state()})
    return time.perf_counter() - started


def _files(run_dir: Path) -> list[Path]:
    step = run_dir / "checkpoints" / "step-1"
    return [p for p in step.rglob("*") if p.is_file() and p.name != "checksums.json"]


def _timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure(server, work: Path, mib: int, rounds: int) -> dict[str, list[float]]:
    from train.checkpoint.tier import RemoteTier
    from train.core.storage.local import LocalStorage
    run_dir = work / "run"
    _sealed(run_dir, mib)
    files, client = _files(run_dir), server.client()
    tier = RemoteTier.from_url(f"s3://{s3server.BUCKET}/bench", "run", LocalStorage(run_dir), 2)
    times: dict[str, list[float]] = {k: [] for k in ("plain put", "plain upload_file",
                                                     "tier upload", "tier mirror")}
    for r in range(rounds):
        times["plain put"].append(_timed(lambda r=r: [client.put_object(
            Bucket=s3server.BUCKET, Key=f"plain/{r}/{p.name}", Body=p.read_bytes())
            for p in files]))
        times["plain upload_file"].append(_timed(lambda r=r: [client.upload_file(
            str(p), s3server.BUCKET, f"managed/{r}/{p.name}") for p in files]))
        times["tier upload"].append(_timed(lambda: [tier.remote.upload(
            f"checkpoints/step-1/{p.relative_to(run_dir / 'checkpoints/step-1')}", p)
            for p in files]))
        times["tier mirror"].append(_timed(lambda: tier.uploader.mirror(1)))
    return times


def blocked(server, work: Path, mib: int, rounds: int) -> tuple[float, float]:
    """Median seconds a save blocks training without and with the tier."""
    from train.checkpoint.tier import RemoteTier
    from train.core.storage.local import LocalStorage
    alone, tiered = [], []
    for r in range(rounds):
        alone.append(_sealed(work / f"alone-{r}", mib))
        run_dir = work / f"tiered-{r}"
        tier = RemoteTier.from_url(f"s3://{s3server.BUCKET}/blocked-{r}", "run",
                                   LocalStorage(run_dir), 2)
        tiered.append(_sealed(run_dir, mib, tier))
        tier.uploader.wait(600)
    return statistics.median(alone), statistics.median(tiered)


def report(mib: int, rounds: int) -> None:
    """Start a server, measure, print (also ``python -m bench.checkpoint --remote``)."""
    if s3server.missing():
        raise SystemExit(f"bench.remote_checkpoint: {s3server.missing()}")
    with tempfile.TemporaryDirectory() as tmp, s3server.s3_server(Path(tmp) / "s3") as server:
        os.environ.update({k: v for k, v in server.env().items() if k.startswith("AWS_")})
        times = measure(server, Path(tmp), mib, rounds)
        size = sum(p.stat().st_size for p in _files(Path(tmp) / "run")) / (1 << 20)
        plain = statistics.median(times["plain put"])
        print(f"remote tier: checkpoint of {size:.0f} MiB, median of {rounds} rounds "
              "(SeaweedFS on 127.0.0.1)")
        for name, seconds in times.items():
            s = statistics.median(seconds)
            print(f"  {name:18s} {s:6.2f} s  {size / s:7.1f} MiB/s  throughput x{plain / s:.2f}"
                  " of plain put")
        alone, tiered = blocked(server, Path(tmp), mib, rounds)
        print(f"training blocked by a save: {alone:.2f} s local, {tiered:.2f} s with the "
              f"remote tier (x{tiered / alone:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    report(args.mib, args.rounds)


if __name__ == "__main__":
    main()
