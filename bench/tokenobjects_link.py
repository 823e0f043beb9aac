"""Token objects over a real link: the S3 server on a host of its own behind a link
shaped to 1 Gbit/s with 20 ms added to each round trip, the reader on another
(bench/linkrig.py: network namespaces, needs root), against a plain boto3 reader in the
same run.

``--files`` objects of ``--mib`` MiB are put in the store, then the node reads them:

1. fetch: the cache's fetch of every object (train/data/shardcache.py: ranged GETs, 8 at
   once), by its read-ahead (two objects at once) and one object after another (a
   reader's own fetches), against boto3's ``download_file`` of the same objects (which
   splits an object above 8 MiB into ranged GETs on 10 threads); as MiB/s and as a
   share of the link (goal: >= 90 %), and the ranges the cache asked for again because
   they lagged (train/data/hedging.py);
2. first batch from an empty cache, ``data.shuffle: blocks`` with a cache of
   ``--cache-objects`` objects and its read-ahead on, against the plain reader (boto3
   ``download_file`` of each object when a batch first touches it, no read-ahead):
   goal <= 2 s;
   and, as a new process has it, the listing (with no S3 client made yet in the process)
   followed by that first batch;
3. resume at ``--resumes`` random steps: a new reader, an empty cache, the time to the
   first batch of that step (goal <= 1 s), against the plain reader;
4. data wait once warm: ``--steps`` batches at a step pace of ``--step-ms`` (a sleep
   standing in for compute), the seconds each batch's read took after the first,
   across group boundaries (goal: about 0), against the plain reader.

    sudo python -m bench.tokenobjects_link [--files 16] [--mib 32] [--cache-objects 4]
        [--batch 256] [--step-ms 20] [--steps 300] [--resumes 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from bench import linkrig
from train.data.objectget import parts
from train.data.shardcache import ShardCache

LENGTH = 1024


class PlainCache(ShardCache):
    """The plain reference: an object is fetched by boto3's own ``download_file`` (default
    client and transfer settings, no check of the bytes) when a read first needs it; a
    client (and boto3 session) per reader, made at its first fetch: what a new process
    pays that lists with another (the cache's reader uses the one its listing made)."""

    _plain = None

    def _fetch(self, f, path: Path) -> None:
        import boto3
        if self._plain is None:
            self._plain = boto3.session.Session().client("s3")
        bucket, key = f.bucket_key()
        part = path.with_name(f".{path.name}.part")
        self._plain.download_file(bucket, key, str(part))
        os.replace(part, path)


def reader(files, cache: ShardCache, limit: int):
    """The windows of ``files`` through ``cache``, and their ``data.shuffle: blocks`` order
    for a cache of ``limit`` bytes (groups of half of it)."""
    from train.data.order import BlockOrder
    from train.data.tokenshards import ShardedWindows, Shards, windows_in
    n = sum(windows_in(f, LENGTH) for f in files)
    data = ShardedWindows(Shards(files, cache), LENGTH, 0, n, 1 << 16)
    return data, BlockOrder(n, 0, data.layout(), group_bytes=limit // 2)


def settle(position: list[int]) -> None:
    """The read-ahead threads end (every later group counts as trained; a fetch under way
    finishes): the next measurement has the link to itself."""
    position[0] = 1 << 62
    for t in threading.enumerate():
        if t.name == "data-read-ahead":
            t.join()


def fetch_all(files, folder: Path, cache_class, ahead: bool = False) -> float:
    """Seconds to fetch ``files``: by the read-ahead (``ahead``), else one after another
    as a reader's own reads do."""
    cache = cache_class(folder, 1 << 40)
    start = time.perf_counter()
    if ahead:
        cache.read_ahead(files).join()
    for f in files:
        cache.local(f)
    took = time.perf_counter() - start
    shutil.rmtree(folder)
    return took


def first_batch(files, folder: Path, limit: int, step: int, batch: int, ahead: bool) -> float:
    """Seconds from a new reader with an empty cache to its batch of ``step``."""
    start = time.perf_counter()
    data, order = reader(files, (ShardCache if ahead else PlainCache)(folder, limit), limit)
    position = [step * batch]
    if ahead:
        data.read_ahead_groups(order, position[0], position[0] + len(data),
                               lambda: position[0])
    data.__getitems__(order.global_batch(step, batch))
    took = time.perf_counter() - start
    settle(position)
    shutil.rmtree(folder)
    return took


def paced(files, folder: Path, limit: int, args, ahead: bool) -> list[float]:
    """Seconds of each batch's read, at a step pace of ``--step-ms``."""
    data, order = reader(files, (ShardCache if ahead else PlainCache)(folder, limit), limit)
    position, reads = [0], []
    if ahead:
        data.read_ahead_groups(order, 0, len(data), lambda: position[0])
    for step in range(args.steps):
        start = time.perf_counter()
        data.__getitems__(order.global_batch(step, args.batch))
        reads.append(time.perf_counter() - start)
        position[0] = (step + 1) * args.batch
        time.sleep(args.step_ms / 1000)
    settle(position)
    shutil.rmtree(folder)
    return reads


def listed_then_first(folder: Path, limit: int, batch: int) -> tuple[float, float]:
    """As in a new process, with no S3 client made yet: (seconds of the listing, of the
    first batch from an empty cache after it)."""
    from train.core.datasets.tokenfiles import resolve
    from train.core.storage import s3
    getattr(s3, "forget", lambda: None)()  # the clients a process keeps, where it keeps any
    start = time.perf_counter()
    files = resolve(f"s3://{linkrig.s3server.BUCKET}/{linkrig.TOKENS}/*.bin", "bench")
    listed = time.perf_counter() - start
    return listed, first_batch(files, folder, limit, 0, batch, True)


class Hedges(logging.Handler):
    """Counts the cache's hedges (train/data/hedging.py: its "asked again" lines)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "asked again" in record.getMessage()


def client_made(make) -> float:
    start = time.perf_counter()
    make()
    return time.perf_counter() - start


def round_trip(endpoint: str) -> float:
    """Median seconds of a TCP connect to the store (one round trip)."""
    url, times = urlparse(endpoint), []
    for _ in range(5):
        start = time.perf_counter()
        socket.create_connection((url.hostname, url.port), timeout=10).close()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def on_node(args) -> dict:
    """Every measurement, on the node (one process; its result as JSON)."""
    import numpy as np

    from train.core.datasets.tokenfiles import resolve
    files = resolve(f"s3://{linkrig.s3server.BUCKET}/{linkrig.TOKENS}/*.bin", "bench")
    work = Path(tempfile.mkdtemp(prefix="link-node-"))
    limit = args.cache_objects * max(f.size for f in files)
    out = {"rtt_s": round_trip(os.environ["AWS_ENDPOINT_URL_S3"]), "ours": [], "plain": [],
           "ahead": []}
    hedges, log = Hedges(), logging.getLogger("train")
    log.addHandler(hedges)
    log.setLevel(logging.INFO)
    for r in range(args.rounds):
        out["ahead"].append(fetch_all(files, work / f"ahead{r}", ShardCache, ahead=True))
        out["ours"].append(fetch_all(files, work / f"ours{r}", ShardCache))
        out["plain"].append(fetch_all(files, work / f"plain{r}", PlainCache))
    out["hedges_fetch"] = hedges.count
    data, order = reader(files, None, limit)  # torch's first calls: not a reader's cost
    order.global_batch(0, args.batch)
    steps = len(data) // args.batch
    out["client_s"] = statistics.median(
        client_made(lambda: ShardCache(work, 0)._s3()) for _ in range(3))
    out["first"] = [first_batch(files, work / "f", limit, 0, args.batch, a)
                    for a in (True, False)]
    out["listed_first"] = listed_then_first(work / "lf", limit, args.batch)
    at = sorted(int(s) for s in np.random.default_rng(1).choice(
        range(1, steps), args.resumes, replace=False))
    out["resume"] = [(s, first_batch(files, work / "r", limit, s, args.batch, True),
                      first_batch(files, work / "r", limit, s, args.batch, False)) for s in at]
    out["paced"] = [paced(files, work / "p", limit, args, a) for a in (True, False)]
    out["steps_per_group"] = limit // 2 // (2 * LENGTH) // args.batch
    out["hedges"] = hedges.count
    shutil.rmtree(work, ignore_errors=True)
    return out


def waits(reads: list[float]) -> str:
    warm = reads[1:]
    med = statistics.median(warm)
    over = [t - med for t in warm if t - med > 0.05]
    return (f"median read {med * 1e3:.1f} ms, max {max(warm) * 1e3:.0f} ms, {len(over)} "
            f"of {len(warm)} steps waited > 50 ms beyond it ({sum(over):.2f} s in all)")


def report(args, rig: linkrig.Rig, got: dict, load: tuple[float, float]) -> None:
    mib = args.files * args.mib
    link = linkrig.RATE_MIB_S
    ranges = 2 * args.rounds * args.files * len(parts(args.mib << 20))  # fetched in 1.
    ours, plain, ahead = min(got["ours"]), min(got["plain"]), min(got["ahead"])
    print(f"{args.files} objects x {args.mib} MiB; the link: {rig.shaping}; measured round "
          f"trip (TCP connect) {got['rtt_s'] * 1e3:.1f} ms; load average {load[0]:.1f} "
          f"before, {load[1]:.1f} after ({os.cpu_count()} cores)")
    print(f"  1. fetch of all (best of {args.rounds}): the cache's read-ahead "
          f"{mib / ahead:.0f} MiB/s ({mib / ahead / link:.0%} of {link:.1f} MiB/s; goal >= "
          f"90%), one object at a time {mib / ours:.0f} MiB/s ({mib / ours / link:.0%}), "
          f"boto3 download_file {mib / plain:.0f} MiB/s ({mib / plain / link:.0%}): ratio "
          f"{plain / ahead:.2f}; rounds {', '.join(f'{mib / s:.0f}' for s in got['ahead'])}"
          f" / {', '.join(f'{mib / s:.0f}' for s in got['ours'])} vs "
          f"{', '.join(f'{mib / s:.0f}' for s in got['plain'])} MiB/s; ranges asked again "
          f"(hedges): {got['hedges_fetch']} of {ranges} here, "
          f"{got['hedges']} in the whole bench")
    a, b = got["first"]
    print(f"  2. first batch ({args.batch} x {LENGTH} tokens, blocks, a cache of "
          f"{args.cache_objects} objects), empty cache: {a:.2f} s (goal <= 2 s), plain "
          f"{b:.2f} s: ratio {a / b:.2f}; a new reader's S3 client (the process's, made "
          f"by the listing): {got['client_s']:.2f} s of it")
    listed, first = got["listed_first"]
    print(f"  2b. as a new process (no S3 client yet): the listing {listed:.2f} s, then the "
          f"first batch {first:.2f} s: {listed + first:.2f} s")
    for step, a, b in got["resume"]:
        print(f"  3. resume at step {step}: first batch {a:.2f} s (goal <= 1 s), plain "
              f"{b:.2f} s: ratio {a / b:.2f}")
    ahead, plain_reads = got["paced"]
    print(f"  4. {args.steps} steps at {args.step_ms} ms of compute each (a group every "
          f"{got['steps_per_group']} steps): read-ahead: {waits(ahead)}; plain: "
          f"{waits(plain_reads)}")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--cache-objects", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--step-ms", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--resumes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--on-node", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse()
    if args.on_node:
        print("RESULT " + json.dumps(on_node(args)), flush=True)
        return
    from tests.harness import netns, s3server
    why = s3server.missing() or netns.available()
    if why:
        raise SystemExit(f"bench.tokenobjects_link: cannot run here: {why}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the rig closes on the way out
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, linkrig.Rig(Path(tmp)) as rig:
        rig.start(args.files, args.mib)
        node_args = [*sys.argv[1:], "--on-node"]
        got = rig.on_node(["-m", "bench.tokenobjects_link", *node_args], 900)
    report(args, rig, got, (before, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
