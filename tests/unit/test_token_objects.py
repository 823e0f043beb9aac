"""``data.kind: tokens`` from object storage, against a real S3 server (SeaweedFS on
127.0.0.1): objects read as the same windows as the local files they were uploaded from,
fetched once into a bounded cache that several processes share, checked against the
listing (a changed or vanished object is one line naming it), the launcher's checks,
and a real training run from objects with the losses of the same run from local files.
Skips without boto3 and weed (``make s3``)."""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.harness import s3server
from tests.harness.checkpoints import rewind
from tests.harness.runs import ROOT, TINY_GPT, limit, losses, merge, run_train, write_config
from tests.unit.test_token_shards import LENGTH, config, token_files, windows
from train.core.datasets.tokenfiles import resolve
from train.core.errors import EXIT_BAD_INPUT, CannotRunHere, ConfigError, DataChanged
from train.data import tokenshards
from train.data.builders import build_data
from train.data.order import BlockOrder, GlobalOrder
from train.data.shardcache import DataFileError, ShardCache, object_lock
from train.data.tokenshards import ShardedWindows, Shards, windows_in


def upload(server, paths: list[Path], prefix: str) -> str:
    """The files as objects under ``prefix``; the glob naming them."""
    for p in paths:
        server.client().upload_file(str(p), s3server.BUCKET, f"{prefix}/{p.name}")
    return f"s3://{s3server.BUCKET}/{prefix}/*.bin"


def test_objects_read_as_the_windows_of_the_local_files(aws, tmp_path):
    paths = token_files(tmp_path / "data")
    url = upload(aws, paths, "same")
    local = build_data(config(tmp_path, str(tmp_path / "data" / "*.bin")))
    cache = tmp_path / "cache"
    remote = build_data(config(tmp_path, url, cache_dir=str(cache)))
    assert windows(remote.train) == windows(local.train)
    assert windows(remote.val) == windows(local.val)
    assert sorted(p.name.split("-", 1)[1] for p in cache.iterdir()
                  if not p.name.startswith(".")) == [p.name for p in paths]


def test_read_ahead_fetches_in_the_order_batches_need_files(aws, tmp_path):
    paths = token_files(tmp_path / "data")
    url = upload(aws, paths, "ahead")
    data = build_data(config(tmp_path, url, cache_dir=str(tmp_path / "cache")))
    batches = [[len(data.train) - 1], [0], [len(data.train) - 1, 3]]
    needed = [f.name.rpartition("/")[2] for f in data.train.files_needed(batches)]
    assert needed == ["part-03.bin", "part-00.bin"]  # the last training window: file 3
    thread = data.train.shards.cache.read_ahead(data.train.files_needed(batches))
    thread.join(limit(60))
    assert sorted(p.name.split("-", 1)[1] for p in (tmp_path / "cache").iterdir()
                  if not p.name.startswith(".")) == ["part-00.bin", "part-03.bin"]


def test_the_cache_stays_within_its_bound_and_refetches_what_it_evicted(aws, tmp_path):
    paths = token_files(tmp_path / "data", sizes=(3000, 3000, 3000))  # 6000 bytes each
    files = resolve(upload(aws, paths, "bound"), "c.yaml")
    cache = ShardCache(tmp_path / "cache", limit=13_000)  # two files fit, not three
    for f in [*files, files[0]]:
        path = cache.local(f)
        assert np.array_equal(np.fromfile(path, dtype=np.uint16),
                              np.fromfile(tmp_path / "data" / f.name.rpartition("/")[2],
                                          dtype=np.uint16))
        held = [p for p in cache.folder.iterdir() if not p.name.startswith(".")]
        assert sum(p.stat().st_size for p in held) <= 13_000


def test_processes_sharing_a_cache_fetch_each_object_once(aws, tmp_path):
    (path,) = token_files(tmp_path / "data", sizes=(400_000,))
    url = upload(aws, [path], "shared")
    script = (f"from train.core.datasets.tokenfiles import resolve\n"
              f"from train.data.shardcache import ShardCache\n"
              f"import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
              f"ShardCache({str(tmp_path / 'cache')!r}, 1 << 30).local("
              f"resolve({url!r}, 'c')[0])\n")
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=aws.env(),
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    said = [p.communicate(timeout=limit(120))[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert sum("fetched s3://" in s for s in said) == 1, said


def test_a_changed_or_vanished_object_is_one_line_naming_it(aws, tmp_path):
    """Bad input (exit 2), not a failure a restart could fix: a restart would list the
    new data and train on it."""
    paths = token_files(tmp_path / "data", sizes=(1000, 1000))
    files = resolve(upload(aws, paths, "corrupt"), "c.yaml")
    s3 = aws.client()
    # the same size, other bytes, after the run listed it: its ETag (MD5) no longer fits
    s3.put_object(Bucket=s3server.BUCKET, Key="corrupt/part-00.bin", Body=b"\1" * 2000)
    s3.delete_object(Bucket=s3server.BUCKET, Key="corrupt/part-01.bin")
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    for f, said in ((files[0], "changed in the store"), (files[1], "no longer in the store")):
        with pytest.raises(DataChanged) as caught:
            cache.local(f)
        line = caught.value.one_line()
        assert line.startswith(f"error: {f.name}: ") and said in line and "\n" not in line
        assert caught.value.exit_code == EXIT_BAD_INPUT
        assert not cache.path(f).exists()
    assert not [p for p in cache.folder.iterdir() if p.name.endswith(".part")]


def test_the_launchers_checks_of_objects(aws, tmp_path, monkeypatch):
    paths = token_files(tmp_path / "data", sizes=(1000, 600_000))  # 1.2 MB: over 1 MiB
    url = upload(aws, paths, "checks")
    with pytest.raises(ConfigError, match=r"data.path: s3://ckpt/nothing/\*.bin: no object"):
        config(tmp_path, f"s3://{s3server.BUCKET}/nothing/*.bin")
    with pytest.raises(ConfigError, match=r"data.path: 's3://Bad_Bucket/x' is not an object"):
        config(tmp_path, "s3://Bad_Bucket/x")
    with pytest.raises(ConfigError, match=r"data.cache_bytes: .*largest file .*1200000 bytes"):
        config(tmp_path, url, cache_bytes=1 << 20)
    assert config(tmp_path, url).data.path == url
    with pytest.raises(ConfigError, match=r"data.cache_bytes: .*two of the largest file .*"
                                          r"1200000 bytes.*data.shuffle=blocks.*2400000"):
        config(tmp_path, url, shuffle="blocks", cache_bytes=2_000_000)
    assert config(tmp_path, url, shuffle="blocks", cache_bytes=2_400_000).data.shuffle == \
        "blocks"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    with pytest.raises(CannotRunHere, match=r"data.path: cannot list .*127\.0\.0\.1:9"):
        config(tmp_path, url)


def test_a_run_from_objects_has_the_losses_of_the_run_from_local_files(aws, tmp_path):
    """And resumed from its checkpoint, it continues as it went on (bitwise)."""
    paths = token_files(tmp_path / "data", sizes=(3000, 2500, 4000), vocab=256)
    url = upload(aws, paths, "run")
    tree = merge(TINY_GPT, {"output": {"dir": str(tmp_path / "runs")},
                            "data": {"kind": "tokens", "vocab_size": 256,
                                     "cache_dir": str(tmp_path / "cache")},
                            "train": {"max_steps": 4}, "checkpoint": {"every_steps": 2}})
    local = write_config(tmp_path / "local.yaml", merge(tree, {"data": {
        "path": str(tmp_path / "data" / "*.bin")}}))
    remote = write_config(tmp_path / "remote.yaml", merge(tree, {"data": {"path": url}}))
    for config_file in (local, remote):
        proc = run_train(config_file, env=aws.env())
        assert proc.returncode == 0, proc.stderr[-3000:]
    ref = losses(tmp_path / "runs" / "local")
    assert losses(tmp_path / "runs" / "remote") == ref and len(ref) == 4
    rewind(tmp_path / "runs" / "remote", 2)
    proc = run_train(remote, env=aws.env())
    assert proc.returncode == 0 and "at step 2" in proc.stderr, proc.stderr[-3000:]
    assert losses(tmp_path / "runs" / "remote") == ref


def test_a_store_that_cannot_be_reached_is_one_line_after_a_few_attempts(aws, tmp_path,
                                                                         monkeypatch):
    (path,) = token_files(tmp_path / "data", sizes=(1000,))
    (f,) = resolve(upload(aws, [path], "gone"), "c.yaml")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # nothing listens
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    with pytest.raises(DataFileError, match=r"^s3://ckpt/gone/part-00.bin: cannot fetch "
                                            r"\(3 attempts\): .*127\.0\.0\.1:9"):
        cache.local(f)
    assert not cache.path(f).exists()


def _take_and_mark(lock: str, marker: str) -> None:
    with object_lock(Path(lock)):
        Path(marker).touch()


def test_a_process_forked_while_a_thread_holds_an_objects_lock_does_not_inherit_it(
        tmp_path):
    """A DataLoader worker forked while the rank's read-ahead thread fetched an object:
    the worker waits for that fetch, then takes the lock itself (it used to wait for a
    lock it held itself, forever, and the rank's step with it)."""
    lock, marker = tmp_path / ".obj.lock", tmp_path / "child-had-it"
    held, release = threading.Event(), threading.Event()

    def fetching() -> None:
        with object_lock(lock):
            held.set()
            release.wait(limit(60))

    thread = threading.Thread(target=fetching)
    thread.start()
    assert held.wait(limit(60))
    child = multiprocessing.get_context("fork").Process(target=_take_and_mark,
                                                        args=(str(lock), str(marker)))
    child.start()
    time.sleep(0.3)
    assert not marker.exists()  # the thread's fetch still holds it
    release.set()
    thread.join(limit(60))
    child.join(limit(60))
    assert child.exitcode == 0 and marker.exists()



def fetched_reading(data, order, steps: int, batch: int, blocks: bool, caplog) -> int:
    """Objects fetched while ``steps`` batches of ``order`` are read one after another,
    the read-ahead on as the trainer runs it (paced by the samples read). With blocks,
    the reader waits at each step for the read-ahead to hold the group it reads (as
    steps longer than a fetch do): the count then does not depend on timing."""
    done = [0]
    if blocks:
        data.read_ahead_groups(order, 0, steps * batch, lambda: done[0])
        spans = list(itertools.islice(order.spans(0), 3 * len(data.shards.files)))
    else:
        data.read_ahead(order.global_batch(s, batch) for s in range(steps))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="train"):
        for step in range(steps):
            if blocks:
                group = next(g for start, end, g in spans if start <= done[0] < end)
                cached = [data.shards.cache.path(data.shards.files[k]) for k in group]
                deadline = time.monotonic() + limit(60)
                while not all(p.exists() for p in cached):
                    assert time.monotonic() < deadline, "the read-ahead fell behind"
                    time.sleep(0.01)
            data.__getitems__(order.global_batch(step, batch))
            done[0] = (step + 1) * batch
    return sum(r.getMessage().startswith("fetched ") for r in caplog.records)


@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "windows"])
def test_blocks_fetch_each_object_about_once_an_epoch_from_a_cache_of_an_eighth(
        aws, tmp_path, caplog, monkeypatch, blocks):
    # a run's steps take long enough for a reader to see each eviction (its map keeps an
    # evicted file readable until it looks): these take microseconds, so it always looks
    monkeypatch.setattr(tokenshards, "RECHECK_S", 0.0)
    paths = token_files(tmp_path / "data", sizes=(3000,) * 16, vocab=1000)
    files = resolve(upload(aws, paths, f"eighth-{blocks}"), "c.yaml")
    limit = 2 * max(f.size for f in files)  # two objects: an eighth of the dataset
    shards = Shards(files, ShardCache(tmp_path / "cache", limit))
    n = sum(windows_in(f, LENGTH) for f in files)
    data = ShardedWindows(shards, LENGTH, 0, n, 1000)
    order = BlockOrder(n, 0, data.layout(), group_bytes=limit // 2) if blocks else \
        GlobalOrder(n, 0)
    batch = 8
    epochs = 2
    fetched = fetched_reading(data, order, epochs * n // batch, batch, blocks, caplog)
    if blocks:  # each group fetched while the one before trains, and never again; one
        # more an epoch allowed: a loaded CI rehearsal once fetched 33 of these 32
        assert fetched <= epochs * (len(files) + 1), fetched
    else:  # what blocks are for: the full shuffle refetches from a cache this small
        assert fetched > 3 * epochs * len(files), fetched
