"""The data metrics of a logging step: ``data/fetched_bytes`` (what the node cache fetched
from object storage: counted in shared memory, so a forked DataLoader worker's fetches
count in its rank's total, and carried exactly through the float32 gather) and
``data/wait_s`` (the slowest rank's wait for its batches), in metrics.jsonl and
TensorBoard (tags that sort after the loss), not on the console. A whole run's:
tests/e2e/test_token_objects_runs.py. Skips the fetch counts without boto3 and weed
(``make s3``)."""

from __future__ import annotations

import json
import multiprocessing

import numpy as np

from tests.harness import s3server
from tests.unit.test_token_shards import token_files
from train.core.config import Config
from train.core.datasets.tokenfiles import resolve
from train.data import shardcache
from train.data.shardcache import ShardCache
from train.observe.intervals import SPLIT, data_metrics, split_count
from train.observe.metrics import MetricsLogger


def _fetch_in_child(cache: ShardCache, f) -> None:
    cache.local(f)


def test_fetched_bytes_count_this_process_and_its_forked_workers_once_each(aws, tmp_path):
    paths = token_files(tmp_path / "data", sizes=(3000, 2500, 4000))
    for p in paths:
        aws.client().upload_file(str(p), s3server.BUCKET, f"counted/{p.name}")
    files = resolve(f"s3://{s3server.BUCKET}/counted/*.bin", "c.yaml")
    read = shardcache.count_fetches()
    assert shardcache.count_fetches() is read  # one counter per process
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    before = read()
    cache.local(files[0])
    cache.local(files[0])  # in the cache: nothing fetched
    assert read() - before == files[0].size == 6000
    child = multiprocessing.get_context("fork").Process(target=_fetch_in_child,
                                                        args=(cache, files[1]))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert read() - before == files[0].size + files[1].size
    assert cache.fetch_ahead(files[2]) and cache.fetch_ahead(files[2])
    assert read() - before == sum(f.size for f in files)


def test_fetched_bytes_cross_the_float32_gather_exactly_and_are_summed_over_ranks():
    big = 5 * (1 << 40) + 12_345  # 5 TiB and change: far past float32's 2**24
    rows = [[1.0, 0.5, 0.25, 0.1, 0.0, 0.0, *split_count(lambda: big)],
            [1.0, 0.5, 0.75, 0.1, 0.0, 0.0, *split_count(lambda: 7)]]
    for row in rows:  # what the gather's float32 tensor carries
        assert all(float(np.float32(v)) == v for v in row[6:])
    assert split_count(None) == (0.0, 0.0) and SPLIT == 1 << 24
    assert data_metrics(rows, counting=True) == {"data/wait_s": 0.75,
                                                 "data/fetched_bytes": big + 7}
    assert data_metrics(rows, counting=False) == {"data/wait_s": 0.75}  # local data


def test_data_metrics_reach_the_files_and_tensorboard_but_not_the_console(tmp_path, capsys):
    from tests.unit.test_training import tensorboard_run
    cfg = Config()
    cfg.output.dir, cfg.run.name, cfg.logging.progress = str(tmp_path), "m", "plain"
    cfg.run_dir.mkdir(parents=True)
    metrics = MetricsLogger(cfg, cfg.run_dir, 0, throughput_unit="tokens")
    for step, fetched in ((1, 6000), (2, 19_000)):
        metrics.log(step, {"loss": 2.0, "data/wait_s": 0.5, "data/fetched_bytes": fetched},
                    step_time=0.1)
    metrics.close()
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["data/fetched_bytes"] for r in rows] == [6000, 19_000]
    assert [r["data/wait_s"] for r in rows] == [0.5, 0.5]
    board = tensorboard_run(cfg.run_dir / "tb" / "train")
    assert [e.value for e in board.Scalars("perf/data_fetched_bytes")] == [6000, 19_000]
    assert [e.value for e in board.Scalars("perf/data_wait_s")] == [0.5, 0.5]
    assert min(board.Tags()["scalars"]) == "loss"  # the run still opens on its loss
    shown = capsys.readouterr().out
    assert "loss 2" in shown and "data/" not in shown
