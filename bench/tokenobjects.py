"""Token files in object storage against the same files on the local disk, on a real S3
server (SeaweedFS on 127.0.0.1, started here: ``make s3``).

``--files`` files of ``--mib`` MiB each are uploaded, then read the way a rank reads
them (train/data/tokenshards.py: the global order's batches of ``--batch`` windows of
1024 tokens, one rank) in the same run:

- fetch: the cache's fetch of every object (train/data/shardcache.py: checked against its
  MD5) against boto3's own ``download_file`` of the same objects (ratio: goal about 1);
- first step from objects with an empty cache (what a new node waits for, the read-ahead
  on) and from local files;
- steady state: seconds per batch once the cache holds the files, against local files
  (the issue's goal: tokens/s within 10 % of local files);
- a cache half the dataset's size: the bytes fetched over 10 steps, as a multiple of
  the dataset (the cost of a full shuffle over a cache smaller than it);
- ``data.shuffle: blocks`` with a cache of two objects (1/8 of the default 16): the
  bytes fetched over one epoch, as a multiple of the dataset, the read-ahead paced by
  the batches read, and the seconds a batch waited for data beyond its read from the
  cache.

    python -m bench.tokenobjects [--files 16] [--mib 8] [--steps 50] [--batch 64]
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from tests.harness import s3server

LENGTH = 1024
EVICTING_STEPS = 10  # each refetches about the whole dataset: a few tell the story


def dataset(files, cache_dir: Path | None, limit: int):
    """The training windows of ``files``, read through a cache at ``cache_dir``."""
    from train.data.shardcache import ShardCache
    from train.data.tokenshards import ShardedWindows, Shards, windows_in
    cache = ShardCache(cache_dir, limit) if cache_dir else None
    n = sum(windows_in(f, LENGTH) for f in files)
    return ShardedWindows(Shards(files, cache), LENGTH, 0, n, 1 << 16)


def batches(n: int, batch: int, steps: int) -> list[list[int]]:
    from train.data.order import GlobalOrder
    order = GlobalOrder(n, seed=0)
    return [order.global_batch(s, batch) for s in range(steps)]


def timed_reads(data, order: list[list[int]]) -> list[float]:
    """Seconds of each batch's read."""
    out = []
    for b in order:
        start = time.perf_counter()
        data.__getitems__(b)
        out.append(time.perf_counter() - start)
    return out


def fetch_ratio(server, files, work: Path) -> tuple[float, float]:
    """(seconds of the cache's fetch of every object, of boto3's download_file)."""
    from train.data.shardcache import ShardCache
    cache = ShardCache(work / "fetch", 1 << 40)
    start = time.perf_counter()
    for f in files:
        cache.local(f)
    ours = time.perf_counter() - start
    start = time.perf_counter()
    for k, f in enumerate(files):
        server.client().download_file(s3server.BUCKET, f.bucket_key()[1], str(work / f"p{k}"))
    return ours, time.perf_counter() - start


class _Fetches(logging.Handler):
    """Counts the bytes of the cache's "fetched NAME (N bytes)" lines."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.bytes = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("fetched "):
            self.bytes += int(record.args[1])


def _as_in_long_steps() -> None:
    """A reader looks whether a file it has mapped was evicted at most once a second
    (tokenshards.RECHECK_S): a run's steps are long enough for it to see each eviction,
    these batches (microseconds once cached) are not, so it looks at every read here."""
    from train.data import tokenshards
    tokenshards.RECHECK_S = 0.0


def evicting(files, work: Path, order: list[list[int]]) -> float:
    """Bytes fetched through a cache of half the dataset, as a multiple of the dataset."""
    _as_in_long_steps()
    log, counter = logging.getLogger("train"), _Fetches()
    log.addHandler(counter)
    log.setLevel(logging.INFO)
    try:
        total = sum(f.size for f in files)
        timed_reads(dataset(files, work / "half", total // 2), order)
    finally:
        log.removeHandler(counter)
    return counter.bytes / total


def blocks_epoch(files, work: Path, batch: int) -> tuple[float, float]:
    """data.shuffle: blocks over a cache of two objects: (bytes fetched in one epoch as a
    multiple of the dataset, the median batch's seconds)."""
    import statistics

    from train.data.order import BlockOrder
    _as_in_long_steps()
    log, counter = logging.getLogger("train"), _Fetches()
    log.addHandler(counter)
    log.setLevel(logging.INFO)
    limit = 2 * max(f.size for f in files)
    data = dataset(files, work / "blocks", limit)
    order = BlockOrder(len(data), 0, data.layout(), group_bytes=limit // 2)
    steps, done, times = len(data) // batch, [0], []
    data.read_ahead_groups(order, 0, steps * batch, lambda: done[0])
    try:
        for step in range(steps):
            times += timed_reads(data, [order.global_batch(step, batch)])
            done[0] = (step + 1) * batch
    finally:
        log.removeHandler(counter)
    return counter.bytes / sum(f.size for f in files), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    if s3server.missing():
        raise SystemExit(f"bench.tokenobjects: {s3server.missing()}")
    from train.core.datasets.tokenfiles import resolve
    with tempfile.TemporaryDirectory() as tmp, s3server.s3_server(Path(tmp) / "s3") as server:
        work = Path(tmp)
        os.environ.update({k: v for k, v in server.env().items() if k.startswith("AWS_")})
        rng = np.random.default_rng(0)
        (work / "local").mkdir()
        for k in range(args.files):
            path = work / "local" / f"part-{k:03d}.bin"
            rng.integers(0, 50000, args.mib << 19, dtype=np.uint16).tofile(path)
            server.client().upload_file(str(path), s3server.BUCKET, f"tokens/{path.name}")
        local = resolve(str(work / "local" / "*.bin"), "bench")
        remote = resolve(f"s3://{s3server.BUCKET}/tokens/*.bin", "bench")
        ours, plain = fetch_ratio(server, remote, work)
        warm = dataset(remote, work / "cache", 1 << 40)
        order = batches(len(warm), args.batch, args.steps)
        warm.read_ahead(order)
        cold_first = timed_reads(warm, order[:1])[0]
        on_disk = dataset(local, None, 0)
        local_first = timed_reads(on_disk, order[:1])[0]
        timed_reads(warm, order)  # every file in the cache now (waits for the read-ahead)
        steady = [(sum(timed_reads(warm, order)), sum(timed_reads(on_disk, order)))
                  for _ in range(3)]
        refetched = evicting(remote, work, order[:EVICTING_STEPS])
        per_epoch, blocks_batch = blocks_epoch(remote, work, args.batch)
    mib = args.files * args.mib
    print(f"{args.files} objects x {args.mib} MiB, batches of {args.batch} x {LENGTH} tokens:")
    print(f"  fetch of all: the cache {ours:.2f} s ({mib / ours:.0f} MiB/s), boto3 "
          f"download_file {plain:.2f} s ({mib / plain:.0f} MiB/s): ratio {plain / ours:.2f}")
    print(f"  first batch: objects, empty cache {cold_first:.2f} s; local files "
          f"{local_first:.3f} s")
    s_obj = min(s for s, _ in steady) / args.steps
    s_loc = min(s for _, s in steady) / args.steps
    print(f"  steady state per batch: objects (cached) {s_obj * 1e3:.2f} ms, local files "
          f"{s_loc * 1e3:.2f} ms: ratio {s_obj / s_loc:.2f} (goal <= 1.1)")
    print(f"  cache of half the dataset: {refetched:.1f}x the dataset fetched in "
          f"{min(args.steps, EVICTING_STEPS)} steps (a cache >= the dataset: 1.0x, once)")
    print(f"  data.shuffle=blocks, a cache of 2 of the {args.files} objects: "
          f"{per_epoch:.2f}x the dataset fetched in one epoch (goal <= 1.10); median batch "
          f"{blocks_batch * 1e3:.2f} ms against {s_obj * 1e3:.2f} ms from a warm cache")


if __name__ == "__main__":
    main()
