"""``data.kind: text`` from object storage, and ``train.data.remote`` (objects for the
user's own code), against a real S3 server (SeaweedFS on 127.0.0.1): objects read as the
same corpus, split and order as the local files they were uploaded from, through the
bounded cache ``data.kind: tokens`` uses; a helper that fetches once, verifies and
caches; every problem one line. Skips without boto3 and weed (``make s3``)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import yaml

from tests.harness import s3server
from tests.harness.runs import TINY_GPT, merge, write_config
from tests.unit.test_token_shards import rank_batches
from train.core.config import load_config
from train.core.datasets.tokenfiles import resolve
from train.core.errors import CannotRunHere, ConfigError, DataChanged
from train.data import remote
from train.data.builders import build_data, read_text_files
from train.data.shardcache import ShardCache

LENGTH = TINY_GPT["model"]["context_length"]


def text_files(folder: Path, sizes=(700, 130, 1500)) -> list[Path]:
    """Files of distinct text (file k: lines naming k and the line's number)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, size in enumerate(sizes):
        text = "".join(f"file {k} line {i}: {'abcdefghij'[i % 10] * (i % 7)}\n"
                       for i in range(size // 10 + 1))[:size]
        paths.append(folder / f"part-{k}.txt")
        paths[-1].write_text(text)
    return paths


def upload(server, paths: list[Path], prefix: str) -> str:
    """The files as objects under ``prefix``; the glob naming them."""
    for p in paths:
        server.client().upload_file(str(p), s3server.BUCKET, f"{prefix}/{p.name}")
    return f"s3://{s3server.BUCKET}/{prefix}/*.txt"


def config(tmp_path: Path, path, **data):
    tree = merge(TINY_GPT, {"output": {"dir": str(tmp_path / "runs")},
                            "data": {"kind": "text", "path": path,
                                     "cache_dir": str(tmp_path / "cache"), **data}})
    return load_config(write_config(tmp_path / "c.yaml", tree))


def samples(dataset) -> list[list[int]]:
    x, y = dataset.__getitems__(list(range(len(dataset))))
    return [[*a, b[-1]] for a, b in zip(x.tolist(), y.tolist(), strict=True)]


def cached(folder: Path) -> list[str]:
    return sorted(p.name.split("-", 1)[1] for p in folder.iterdir() if not p.name.startswith("."))


def test_objects_read_as_the_same_text_as_the_local_files(aws, tmp_path):
    """A glob of objects, and a list mixing local files and objects: the same samples,
    split, order at world size 1 and 2, and data hash as the local files."""
    paths = text_files(tmp_path / "data")
    url = upload(aws, paths, "same")
    local = build_data(config(tmp_path, str(tmp_path / "data" / "*.txt")))
    bucket = f"s3://{s3server.BUCKET}/same"
    mixed = [str(paths[0]), f"{bucket}/part-1.txt", f"{bucket}/part-[2].txt"]
    for path in (url, mixed):
        got = build_data(config(tmp_path, path))
        assert samples(got.train) == samples(local.train)
        assert samples(got.val) == samples(local.val) != []
        assert got.data_hash == local.data_hash
        assert rank_batches(got.train, 2, 0, 12) == rank_batches(local.train, 1, 0, 12)
    assert cached(tmp_path / "cache") == ["part-0.txt", "part-1.txt", "part-2.txt"]


def test_only_the_objects_max_bytes_reads_are_fetched(aws, tmp_path):
    paths = text_files(tmp_path / "data")
    url = upload(aws, paths, "cut")
    local = build_data(config(tmp_path, [str(p) for p in paths], max_bytes=800))
    got = build_data(config(tmp_path, url, max_bytes=800))  # part-0 and 100 bytes of part-1
    assert samples(got.train) == samples(local.train)
    assert cached(tmp_path / "cache") == ["part-0.txt", "part-1.txt"]


def test_objects_that_cannot_be_text_data_are_one_line(aws, tmp_path):
    paths = text_files(tmp_path / "data", sizes=(20, 1_200_000))  # 1.2 MB: over 1 MiB
    url = upload(aws, paths, "bad")
    for path, more, said in (
            (f"s3://{s3server.BUCKET}/nothing/*.txt", {}, "data.path: .*no object matches"),
            (f"s3://{s3server.BUCKET}/bad/part-0.txt", {}, "data.path: 20 bytes of text"),
            ([str(tmp_path / "no.txt")], {}, "data.path: .*no.txt: no such file"),
            (url, {"cache_bytes": 1 << 20}, "data.cache_bytes: .*largest file .*1200000 bytes")):
        with pytest.raises(ConfigError, match=said) as raised:
            config(tmp_path, path, **more)
        assert raised.value.exit_code == 2 and "\n" not in raised.value.one_line()
    files = resolve(url, "c.yaml", "text")  # the listing a worker starts from
    # the same size, other bytes, after it was listed: its ETag no longer fits
    aws.client().put_object(Bucket=s3server.BUCKET, Key="bad/part-0.txt", Body=b"x" * 20)
    with pytest.raises(DataChanged, match=r"^s3://ckpt/bad/part-0.txt: changed in the store"):
        read_text_files(files, 0, ShardCache(tmp_path / "cache", 1 << 30))


# ------------------------------------------------------------------ train.data.remote
@pytest.fixture
def helper_cache(tmp_path):
    """train.data.remote's cache in this test's folder, its memory of objects cleared."""
    remote.use_cache(tmp_path / "helper", 1 << 30)
    remote._known.clear()
    yield tmp_path / "helper"
    remote.use_cache(None, remote.DEFAULT_CACHE_BYTES)
    remote._known.clear()


def test_the_helper_fetches_once_verifies_and_opens_the_local_copy(aws, tmp_path, helper_cache,
                                                                   caplog):
    (path,) = text_files(tmp_path / "data", sizes=(5000,))
    upload(aws, [path], "helper")
    url = f"s3://{s3server.BUCKET}/helper/part-0.txt"
    with caplog.at_level(logging.INFO, logger="train"):
        first, again = remote.fetch(url), remote.fetch(url)
    assert first == again and first.parent == helper_cache
    assert first.read_bytes() == path.read_bytes()
    assert sum("fetched s3://" in r.getMessage() for r in caplog.records) == 1
    with remote.open(url, "r", encoding="utf-8") as f:
        assert f.read() == path.read_text()
    # replaced after this process first asked for it, and evicted: the refetch says so
    aws.client().put_object(Bucket=s3server.BUCKET, Key="helper/part-0.txt", Body=b"y" * 5000)
    first.unlink()
    with pytest.raises(DataChanged, match=r"^s3://ckpt/helper/part-0.txt: changed in the "
                                          r"store since the run listed it"):
        remote.fetch(url)


def test_the_helpers_errors_are_one_line(aws, helper_cache, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"^s3://ckpt/helper/nope.txt: no such object"):
        remote.fetch(f"s3://{s3server.BUCKET}/helper/nope.txt")
    for bad in ("/local/file.txt", "s3://ckpt/", "s3://ckpt/a/*.txt", "s3://Bad_Bucket/k"):
        with pytest.raises(ValueError, match="is not an object URL"):
            remote.fetch(bad)
    with pytest.raises(ValueError, match="reading only"):
        remote.open(f"s3://{s3server.BUCKET}/helper/x.txt", "wb")
    # nothing listens; other AWS variables: the process's data client is made anew for them
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    with pytest.raises(CannotRunHere, match=r"cannot read s3://ckpt/x.txt at "
                                            r"http://127\.0\.0\.1:9") as raised:
        remote.fetch(f"s3://{s3server.BUCKET}/x.txt")
    assert raised.value.exit_code == 3 and "\n" not in raised.value.one_line()


def test_without_boto3_the_helper_is_the_exit_3_line_of_every_s3_url(helper_cache, monkeypatch):
    real = remote.importlib.util.find_spec
    monkeypatch.setattr(remote.importlib.util, "find_spec",
                        lambda name, *a: None if name == "boto3" else real(name, *a))
    with pytest.raises(CannotRunHere) as raised:
        remote.fetch("s3://bucket/x.txt")
    assert raised.value.exit_code == 3
    assert "s3://bucket/x.txt needs boto3, which is not installed here: pip install " \
           "'trainpod[s3]'" in raised.value.one_line()


def test_a_custom_factory_reads_objects_through_the_runs_cache(aws, tmp_path, helper_cache,
                                                               project, monkeypatch):
    """The example's stored_waves: the trainer points the helper at data.cache_dir before
    it calls the factory; a missing object is the factory's one line, exit 2."""
    import torch
    waves = torch.randn(64, 40)
    torch.save(waves, tmp_path / "waves.pt")
    aws.client().upload_file(str(tmp_path / "waves.pt"), s3server.BUCKET, "factory/waves.pt")
    monkeypatch.chdir(project)
    monkeypatch.setitem(sys.modules, "waves", None)  # imported from here, forgotten after
    del sys.modules["waves"]
    config = yaml.safe_load((project / "config.yaml").read_text())
    tree = merge(config, {"output": {"dir": str(tmp_path / "runs")},
                          "data": {"factory": "waves:stored_waves",
                                   "cache_dir": str(tmp_path / "run-cache")}})
    tree["data"]["args"] = {"url": f"s3://{s3server.BUCKET}/factory/waves.pt"}
    data = build_data(load_config(write_config(tmp_path / "c.yaml", tree)))
    assert torch.equal(data.train[0][0], waves[0, :32]) and len(data.val) == 8
    assert cached(tmp_path / "run-cache") == ["waves.pt"]
    tree["data"]["args"]["url"] = f"s3://{s3server.BUCKET}/factory/gone.pt"
    with pytest.raises(ConfigError, match=r"data.factory: waves:stored_waves\(\*\*data.args\) "
                                          r"failed: FileNotFoundError: s3://ckpt/factory/gone"):
        build_data(load_config(write_config(tmp_path / "c.yaml", tree)))
