"""The data cache fetches a large object as ranged GETs on several connections
(train/data/objectget.py), against a real S3 server (SeaweedFS on 127.0.0.1): the copy
is byte for byte the object, each range asks for the listed ETag, an object replaced
mid-fetch is the one line of a changed object (whether or not the store honours
If-Match), bytes damaged on the way are fetched again, and no partial file is ever
visible to a reader. Parts are made small here so that objects of a few hundred KiB
have many. Skips without boto3 and weed (``make s3``)."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from pathlib import Path

import pytest

from tests.harness import s3server
from train.core.datasets.tokenfiles import resolve
from train.core.errors import EXIT_BAD_INPUT, DataChanged
from train.core.storage import s3
from train.data import objectget, shardcache
from train.data.shardcache import ShardCache

PART = 64 << 10


@pytest.fixture(autouse=True)
def small_parts(monkeypatch):
    monkeypatch.setattr(objectget, "PART", PART)
    monkeypatch.setattr(objectget, "MIN_PART", PART)


class Spy:
    """The cache's boto3 client, with a hook after each GET's answer: what each GET asked
    (``asked``); ``after(answer)`` may change the answer or the store."""

    def __init__(self, real, after=None, if_match: bool = True):
        self.real, self.after, self.if_match = real, after, if_match
        self.asked: list[dict] = []
        self.lock = threading.Lock()

    def get_object(self, **ask):
        with self.lock:
            self.asked.append(dict(ask))
        if not self.if_match:  # a store that ignores the condition
            ask.pop("IfMatch", None)
        got = self.real.get_object(**ask)
        if self.after is not None:
            with self.lock:
                got = self.after(got)
        return got

    def head_object(self, **ask):
        return self.real.head_object(**ask)


def spied(cache: ShardCache, **spy) -> Spy:
    real = cache._s3()
    cache._client = (os.getpid(), Spy(real, **spy))
    return cache._client[1]


def objects(aws, tmp_path: Path, prefix: str, sizes=(21 * PART + 12345, 5 * PART),
            multipart: bool = True):
    """Objects of random bytes (with ``multipart`` the first one a multipart upload, of
    one part: its ETag is no MD5; the others one PUT each); their files and listing."""
    from boto3.s3.transfer import TransferConfig
    paths = []
    for k, size in enumerate(sizes):
        paths.append(tmp_path / "data" / f"part-{k:02d}.bin")
        paths[-1].parent.mkdir(exist_ok=True)
        paths[-1].write_bytes(os.urandom(size))
        config = TransferConfig(multipart_threshold=1 if k == 0 and multipart else 1 << 30)
        aws.client().upload_file(str(paths[-1]), s3server.BUCKET, f"{prefix}/{paths[-1].name}",
                                 Config=config)
    return paths, resolve(f"s3://{s3server.BUCKET}/{prefix}/*.bin", "c.yaml")


def test_a_fetch_in_ranges_is_the_object_byte_for_byte(aws, tmp_path):
    paths, files = objects(aws, tmp_path, "ranges")
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    spy = spied(cache)
    read = shardcache.count_fetches()
    before = read()
    for path, f in zip(paths, files, strict=True):
        assert len(objectget.parts(f.size)) > 1
        assert cache.local(f).read_bytes() == path.read_bytes()
    assert read() - before == sum(f.size for f in files)  # data/fetched_bytes
    # a set: a range asked twice (a hedge, train/data/hedging.py, on a loaded machine) once
    ranges = sorted({tuple(map(int, a["Range"][len("bytes="):].split("-"))) for a in spy.asked
                     if a["Key"].endswith("part-00.bin")})
    assert ranges[0][0] == 0 and ranges[-1][1] == files[0].size - 1
    assert all(b + 1 == c for (_, b), (c, _) in itertools.pairwise(ranges))  # no gap or overlap
    assert all(a["IfMatch"] == f'"{files[int(a["Key"][-6:-4])].etag}"' for a in spy.asked)
    assert sorted(p.name for p in cache.folder.iterdir() if not p.name.startswith(".")) == \
        sorted(cache.path(f).name for f in files)


@pytest.mark.parametrize("if_match", [True, False], ids=["if-match", "store-ignores-it"])
def test_an_object_replaced_mid_fetch_is_one_line_and_never_visible(aws, tmp_path, if_match):
    _, files = objects(aws, tmp_path, f"replaced-{if_match}", sizes=(21 * PART + 7,))
    (f,) = files
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    seen: list[list[str]] = []

    def replace_once(got):
        # every range's answer passes here: the copy is never visible while it arrives
        seen.append([p.name for p in cache.folder.iterdir() if not p.name.startswith(".")])
        if len(seen) == 1:  # the same size, other bytes: ranges asked from now on differ
            aws.client().put_object(Bucket=s3server.BUCKET, Key=f.bucket_key()[1],
                                    Body=os.urandom(f.size))
        return got

    spy = spied(cache, after=replace_once, if_match=if_match)
    with pytest.raises(DataChanged) as caught:
        cache.local(f)
    line = caught.value.one_line()
    assert line.startswith(f"error: {f.name}: changed in the store") and "\n" not in line
    assert caught.value.exit_code == EXIT_BAD_INPUT
    assert len(spy.asked) > objectget.IN_FLIGHT  # later ranges were asked after the change
    assert seen and not any(seen)
    assert not cache.path(f).exists()
    assert not [p for p in cache.folder.iterdir() if p.name.endswith(".part")]


class Damaged:
    """An answer's body with its first byte flipped."""

    def __init__(self, body):
        self.body, self.first = body, True

    def read(self, n):
        data = self.body.read(n)
        if self.first and data:
            self.first, data = False, bytes([data[0] ^ 1]) + data[1:]
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.body.close()


def test_a_range_damaged_on_the_way_is_fetched_again(aws, tmp_path, caplog):
    paths, files = objects(aws, tmp_path, "damaged", sizes=(9 * PART + 3,), multipart=False)
    (f,) = files
    assert objectget.PLAIN_MD5.match(f.etag)  # a single-part upload: its ETag is the MD5
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    flipped, fourth = [], objectget.parts(f.size)[3][0]

    def damage_once(got):
        if not flipped and got["ContentRange"].startswith(f"bytes {fourth}-"):
            flipped.append(got["ContentRange"])
            got["Body"] = Damaged(got["Body"])
        return got

    spied(cache, after=damage_once)
    with caplog.at_level(logging.WARNING, logger="train"):
        assert cache.local(f).read_bytes() == paths[0].read_bytes()
    assert flipped
    assert any("MD5" in r.getMessage() and "trying again" in r.getMessage()
               for r in caplog.records)


def test_the_listing_and_every_cache_of_a_process_share_one_client(aws, tmp_path, monkeypatch):
    """Making a client costs 0.1-0.35 s on a loaded node: the listing pays it, before the
    model is built, and a cache's first fetch does not pay it again."""
    paths, _ = objects(aws, tmp_path, "one-client", sizes=(3 * PART,))
    made, make = [], s3.client
    monkeypatch.setattr(s3, "client", lambda *a: made.append(a) or make(*a))
    s3.forget()  # as in a new process
    (f,) = resolve(f"s3://{s3server.BUCKET}/one-client/*.bin", "c.yaml")
    for k in range(2):  # a new reader: the same process's client
        cache = ShardCache(tmp_path / f"cache{k}", 1 << 30)
        assert cache.local(f).read_bytes() == paths[0].read_bytes()
        assert cache._s3() is s3.shared()
    assert len(made) == 1
    monkeypatch.setenv("AWS_REGION", "eu-west-3")  # other AWS variables: another client
    assert s3.shared() is not cache._s3() and len(made) == 2
