"""What ``doctor`` and ``train --dry-run`` say about a ``data.kind: tokens`` dataset: its
files, bytes and windows, its order, and what reading it fetches per epoch and node
(:mod:`train.core.datasets.footprint`): ``blocks`` about the dataset's bytes in groups
of half the cache, ``windows`` once when the cache holds the dataset and an estimate of
its refetches when it does not; ``doctor --json`` carries the numbers. A training launch
does not list the data for it. Objects: against a real S3 server (``make s3``)."""

from __future__ import annotations

import json

import pytest

from launcher.commands import doctor
from launcher.detection.hardware import Hardware
from launcher.planning import environ
from launcher.running import runner
from tests.harness import s3server
from tests.harness.runs import ROOT, TINY_GPT, entry, merge, write_config
from tests.unit.test_runner import CPU_TORCH
from tests.unit.test_token_shards import LENGTH, token_files
from train.core.config import Config
from train.core.datasets import footprint
from train.core.datasets.tokenfiles import TokenFile
from train.data.order import BlockOrder

MIB = 1 << 20


def objects(*sizes: int) -> list[TokenFile]:
    return [TokenFile(f"s3://b/p/part-{k:02d}.bin", size, "e") for k, size in enumerate(sizes)]


def described(files: list[TokenFile], shuffle: str, cache_bytes: int, nodes: int = 1) -> dict:
    cfg = Config()
    cfg.data.kind, cfg.data.shuffle, cfg.data.cache_bytes = "tokens", shuffle, cache_bytes
    cfg.model.context_length = 128
    return footprint.describe(cfg, files, nodes)


def test_blocks_fetch_the_dataset_once_an_epoch_in_groups_of_half_the_cache():
    d = described(objects(*[8 * MIB] * 16), "blocks", 32 * MIB)
    assert (d["files"], d["objects"], d["bytes"], d["tokens"]) == (16, 16, 128 * MIB, 64 * MIB)
    assert d["windows"] == 16 * ((4 * MIB - 1) // 128)
    assert (d["group_bytes"], d["groups"]) == (16 * MIB, 8)
    assert d["fetch_per_epoch_bytes"] == 128 * MIB and d["cache_share"] == 0.25
    text = footprint.lines(d)
    assert text[0].startswith("tokens: 16 files (16 in object storage), 128.0 MiB, ")
    assert text[1] == ("shuffle blocks: groups of up to 16.0 MiB (data.cache_bytes/2), about "
                       "8 an epoch; fetch per epoch per node about 128.0 MiB (1.00x the "
                       "dataset)")


def test_windows_fetch_once_from_a_cache_that_holds_the_dataset_and_refetch_from_less():
    files = objects(*[8 * MIB] * 8)
    whole = described(files, "windows", 64 * MIB)
    assert whole["fetch_per_epoch_bytes"] == 64 * MIB and "group_bytes" not in whole
    assert "holds the whole dataset: each object fetched once per node (64.0 MiB)" in \
        footprint.lines(whole)[1]
    half = described(files, "windows", 32 * MIB)
    train_windows = half["windows"] * (1 - Config().data.val_fraction)
    assert half["cache_share"] == 0.5
    assert half["fetch_per_epoch_bytes"] == round(train_windows * 0.5 * 8 * MIB)
    assert footprint.lines(half)[1].startswith(
        "shuffle windows: refetches: the cache holds 50% of the dataset; fetch per epoch per "
        "node about ")
    # two nodes read half the windows each: half the refetches per node
    assert described(files, "windows", 32 * MIB, nodes=2)["fetch_per_epoch_bytes"] == \
        pytest.approx(half["fetch_per_epoch_bytes"] / 2, rel=1e-6)


def test_local_files_fetch_nothing():
    local = [TokenFile("/data/a.bin", 3 * MIB), TokenFile("/data/b.bin", MIB)]
    for shuffle in ("windows", "blocks"):
        d = described(local, shuffle, 2 * MIB)
        assert d["objects"] == d["object_bytes"] == d["fetch_per_epoch_bytes"] == 0
        assert footprint.lines(d)[1].endswith("local files: nothing fetched")


def test_the_groups_counted_are_those_block_order_packs_in_listing_order():
    sizes = [3 * MIB, 5 * MIB, MIB, 7 * MIB, 2 * MIB, 2 * MIB, 4 * MIB, 6, 8 * MIB]
    files = [TokenFile(f"/d/{k}.bin", s) for k, s in enumerate(sizes)]
    layout = [(footprint.windows_in(f, 128), f.size) for f in files]
    order = BlockOrder(sum(n for n, _ in layout), 0, layout, group_bytes=8 * MIB)
    assert footprint.groups_of(files, 128, 8 * MIB) == \
        len(order._groups(list(range(len(files))))) == 4  # the 6-byte file: none


def tokens_config(tmp_path, path, **data) -> str:
    return str(write_config(tmp_path / "tokens.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path / "runs")},
        "data": {"kind": "tokens", "path": path, "vocab_size": 1000, **data}})))


def prepare(request: runner.Request, env: dict | None = None) -> runner.Prepared:
    return runner.prepare(request, environ.read({"PATH": "/usr/bin", **(env or {})}),
                          hardware=Hardware(cpus=4), tb=CPU_TORCH, master_port=29511)


def test_doctor_and_a_dry_run_show_it_and_a_launch_does_not_list_for_it(tmp_path):
    token_files(tmp_path / "data", sizes=(3000, 2500, 4000))
    config = tokens_config(tmp_path, str(tmp_path / "data" / "*.bin"), shuffle="blocks",
                           cache_bytes=MIB)
    said = prepare(runner.Request("doctor", config))
    assert (said.data["files"], said.data["bytes"], said.data["groups"]) == (3, 19_000, 1)
    assert said.data["windows"] == sum((n - 1) // LENGTH for n in (3000, 2500, 4000))
    dry = prepare(runner.Request("train", config, dry_run=True))
    assert dry.data == said.data
    shown = dry.plan.render(dry.data["lines"]).splitlines()
    assert "# data: shuffle blocks: groups of up to 512.0 KiB (data.cache_bytes/2), about 1 " \
           "an epoch; local files: nothing fetched" in shown
    assert shown[-1].endswith("device=cpu distributed.backend=gloo")  # still a command
    assert prepare(runner.Request("train", config)).data is None


def test_doctor_json_carries_the_numbers_for_objects(s3_server, tmp_path):
    sizes = (600_000, 500_000, 700_000)  # tokens: 3.6 MB of objects
    for p in token_files(tmp_path / "data", sizes=sizes):
        s3_server.client().upload_file(str(p), s3server.BUCKET, f"doctor/{p.name}")
    config = tokens_config(tmp_path, f"s3://{s3server.BUCKET}/doctor/*.bin",
                           cache_bytes=2 * MIB)
    report = json.loads(entry("doctor", "--json", config, cwd=ROOT, env=s3_server.env()).stdout)
    data = report["data"]
    assert (data["objects"], data["object_bytes"], data["shuffle"]) == (3, 3_600_000, "windows")
    assert data["cache_share"] == pytest.approx(2 * MIB / 3_600_000)
    assert data["fetch_per_epoch_bytes"] > 3_600_000
    text = entry("doctor", config, cwd=ROOT, env=s3_server.env()).stdout
    assert "data       shuffle windows: refetches: the cache holds 58% of the dataset" in text
    assert doctor.render(report).count("\ndata       ") == 2
