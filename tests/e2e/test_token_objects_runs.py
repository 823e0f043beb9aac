"""Token and text files in object storage, whole runs: two processes started by the
launcher read their shards from a real S3 server (SeaweedFS on 127.0.0.1) and train with
the losses of one process reading the same files from the local disk (whose launcher
kept its scan of the files' ids in the run directory), their metrics counting each
object's bytes once (``data/fetched_bytes``); in data.shuffle=blocks order over several
groups, stopped in the second and resumed with an empty cache, the same; a text run
from objects has the
losses of the same run from local files; an object replaced mid-run stops it with one
line and exit 2, and the next start refuses to resume on the changed data. In process,
and one process from the store resumed: tests/unit/test_token_objects.py,
tests/unit/test_text_objects.py. Skips without boto3 and weed (``make s3``)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.harness import s3server
from tests.harness.runs import (
    ENTRY,
    ROOT,
    TINY_GPT,
    entry,
    limit,
    losses,
    merge,
    read_metrics,
    write_config,
)
from tests.unit.test_text_objects import text_files
from tests.unit.test_token_shards import token_files
from tests.unit.test_training import tensorboard_run

pytestmark = pytest.mark.skipif(s3server.missing() is not None,
                                reason=str(s3server.missing()))
STEPS = 6


def test_two_processes_from_objects_train_as_one_from_local_files(tmp_path):
    """In the default data.shuffle=windows order; blocks: the next test (the order's own
    properties: tests/unit/test_block_order.py)."""
    paths = token_files(tmp_path / "data", sizes=(3000, 2500, 4000), vocab=256)
    tree = merge(TINY_GPT, {"output": {"dir": str(tmp_path / "runs")},
                            "data": {"kind": "tokens", "vocab_size": 256,
                                     "cache_dir": str(tmp_path / "cache")},
                            "train": {"max_steps": STEPS}})
    local = write_config(tmp_path / "local.yaml", merge(tree, {"data": {
        "path": [str(p) for p in paths]}}))
    proc = entry("train", str(local), cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = losses(tmp_path / "runs" / "local")
    # the launcher's scan of the local files, kept for the workers and the next start
    scanned = json.loads((tmp_path / "runs" / "local" / "token-ids.json").read_text())
    assert sorted(scanned) == [str(p.resolve()) for p in paths]
    assert {e["largest"] for e in scanned.values()} == {255}
    with s3server.s3_server(tmp_path / "s3") as server:
        for p in paths:
            server.client().upload_file(str(p), s3server.BUCKET, f"tokens/{p.name}")
        remote = write_config(tmp_path / "remote.yaml", merge(tree, {"data": {
            "path": f"s3://{s3server.BUCKET}/tokens/part-*.bin"}}))
        proc = entry("train", str(remote), "distributed.nproc_per_node=2", cwd=ROOT,
                     env=server.env(), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = losses(tmp_path / "runs" / "remote")
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:  # the same samples; the reduction order of two processes differs
        assert math.isclose(ref[step], got[step], rel_tol=1e-5), (step, ref[step], got[step])
    fetched_as_the_cache_holds(tmp_path, paths)


# blocks of one object each: a cache of 1 MiB holds two of these 520 kB objects, so a
# group (half the cache) is one object, and an epoch three groups of about 60 steps
BLOCK_STEPS, HELD_AT = 150, 75


def test_blocks_from_the_store_stopped_in_the_second_group_resume_as_one_local_run(
        s3_server, tmp_path):
    """data.shuffle=blocks over three groups: two processes reading the objects are held at
    step 75 (the second group), stopped by SIGTERM, and started again with an empty
    cache; they resume at the exact next sample, fetched from the store, and every logged
    loss of both incarnations is that of one uninterrupted process reading local files.
    Neither incarnation fetched an object twice."""
    paths = token_files(tmp_path / "data", sizes=(260_000,) * 3, vocab=256)
    for p in paths:
        s3_server.client().upload_file(str(p), s3server.BUCKET, f"blocks/{p.name}")
    tree = merge(TINY_GPT, {"output": {"dir": str(tmp_path / "runs")},
                            "data": {"kind": "tokens", "vocab_size": 256, "shuffle": "blocks",
                                     "cache_bytes": 1 << 20, "cache_dir": str(tmp_path / "c")},
                            "train": {"max_steps": BLOCK_STEPS, "global_batch_size": 256},
                            "logging": {"every_steps": 5}, "checkpoint": {"every_steps": 1000}})
    local = write_config(tmp_path / "local.yaml", merge(tree, {"data": {
        "path": [str(p) for p in paths]}}))
    proc = entry("train", str(local), cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    remote = write_config(tmp_path / "remote.yaml", merge(tree, {"data": {
        "path": f"s3://{s3server.BUCKET}/blocks/part-*.bin"}}))
    held = held_and_stopped(s3_server, tmp_path, remote)
    first = losses(tmp_path / "runs" / "remote")
    assert HELD_AT <= max(first) < BLOCK_STEPS, sorted(first)
    fetched = [[r["data/fetched_bytes"] for r in read_metrics(tmp_path / "runs" / "remote")
                if "loss" in r]]
    shutil.rmtree(tmp_path / "c")  # the second incarnation fetches what it needs again
    again = entry("train", str(remote), "distributed.nproc_per_node=2", cwd=ROOT,
                  env=s3_server.env(), timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {tmp_path / 'runs' / 'remote' / 'checkpoints'}" in again.stderr
    got, ref = losses(tmp_path / "runs" / "remote"), losses(tmp_path / "runs" / "local")
    assert sorted(got) == sorted(ref) and max(ref) == BLOCK_STEPS
    for step in ref:  # the same samples; the reduction order of two processes differs
        assert math.isclose(ref[step], got[step], rel_tol=1e-5), (step, ref[step], got[step])
    rows = [r for r in read_metrics(tmp_path / "runs" / "remote") if "loss" in r]
    fetched.append([r["data/fetched_bytes"] for r in rows if r["step"] > held])
    size = paths[0].stat().st_size
    assert all(0 < f[-1] <= 3 * size and f == sorted(f) for f in fetched), fetched


class HeldRun:
    """``config`` on 2 processes, held after step ``at`` (tests/e2e/test_object_storage_runs.py's
    HOLD patch) until :meth:`go`; its console in ``held.txt``."""

    def __init__(self, s3_server, tmp_path, config, at: int):
        from tests.e2e.test_object_storage_runs import HOLD
        self.hold, site = tmp_path / "hold", tmp_path / "site"
        self.hold.mkdir()
        site.mkdir()
        (site / "sitecustomize.py").write_text(HOLD)
        env = s3_server.env(PYTHONPATH=str(site), HOLD_DIR=str(self.hold), HOLD_AT=str(at))
        self.console = tmp_path / "held.txt"
        with self.console.open("w") as out:
            self.proc = subprocess.Popen([sys.executable, ENTRY, "train", str(config),
                                          "distributed.nproc_per_node=2"], cwd=ROOT, env=env,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.deadline = time.monotonic() + limit(240)

    def text(self) -> str:
        return self.console.read_text()

    def until(self, done) -> None:
        while not done():
            assert self.proc.poll() is None and time.monotonic() < self.deadline, self.text()
            time.sleep(0.1)

    def held(self) -> None:
        """Both ranks at the hold."""
        self.until(lambda: len(list(self.hold.glob("held-*"))) >= 2)

    def go(self) -> int:
        (self.hold / "go").touch()
        return self.proc.wait(timeout=limit(240))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def held_and_stopped(s3_server, tmp_path, config) -> int:
    """The run of ``config`` on 2 processes held at HELD_AT, SIGTERM to its group while
    held, let go: it checkpoints and exits 143. The step it stopped at."""
    run = HeldRun(s3_server, tmp_path, config, HELD_AT)
    try:
        run.held()
        os.killpg(run.proc.pid, signal.SIGTERM)
        run.until(lambda: run.text().count("received SIGTERM: stopping") >= 2)  # both ranks
        assert run.go() == 143, run.text()[-3000:]
    finally:
        run.kill()
    return int(run.text().split("stopped at step ")[1].split()[0])


def fetched_as_the_cache_holds(tmp_path, paths) -> None:
    """data/fetched_bytes at every logging step, growing to the bytes of the objects the
    node's cache holds (each fetched once by one of the two processes), in TensorBoard
    too; data/wait_s everywhere; no fetched bytes for local files."""
    rows = {n: [r for r in read_metrics(tmp_path / "runs" / n) if "loss" in r]
            for n in ("local", "remote")}
    assert all(r["data/wait_s"] >= 0 for n in rows for r in rows[n])
    assert not any("data/fetched_bytes" in r for r in rows["local"])
    fetched = [r["data/fetched_bytes"] for r in rows["remote"]]
    held = sum(p.stat().st_size for p in (tmp_path / "cache").iterdir()
               if not p.name.startswith("."))
    assert fetched == sorted(fetched) and len(fetched) == STEPS, fetched
    assert fetched[-1] == held == sum(p.stat().st_size for p in paths), (fetched, held)
    board = tensorboard_run(tmp_path / "runs" / "remote" / "tb" / "train")
    assert [e.value for e in board.Scalars("perf/data_fetched_bytes")] == fetched


def test_a_text_run_from_objects_has_the_losses_of_the_run_from_local_files(s3_server,
                                                                            tmp_path):
    paths = text_files(tmp_path / "data", sizes=(9000, 700, 12000))
    for p in paths:
        s3_server.client().upload_file(str(p), s3server.BUCKET, f"text/{p.name}")
    tree = merge(TINY_GPT, {"output": {"dir": str(tmp_path / "runs")},
                            "data": {"kind": "text", "cache_dir": str(tmp_path / "cache")},
                            "train": {"max_steps": STEPS}})
    runs = {"local": str(tmp_path / "data" / "*.txt"),
            "remote": f"s3://{s3server.BUCKET}/text/part-*.txt"}
    for name, path in runs.items():
        config = write_config(tmp_path / f"{name}.yaml", merge(tree, {"data": {"path": path}}))
        proc = entry("train", str(config), cwd=ROOT, env=s3_server.env(), timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path / "runs" / "remote") == losses(tmp_path / "runs" / "local")
    assert len(losses(tmp_path / "runs" / "local")) == STEPS
    manifests = [json.loads((tmp_path / "runs" / n / "manifest.json").read_text())
                 for n in runs]
    assert manifests[0]["data_sha256"] == manifests[1]["data_sha256"]


def test_an_object_replaced_mid_run_is_exit_2_and_never_trained_on(s3_server, tmp_path):
    """Two processes, a DataLoader worker each: held after step 3 (checkpoint step-2
    sealed), part-01.bin is replaced in the store and the node's copy removed, so the next
    read fetches it again: one line naming it, exit 2, no restart. The next start lists
    the new object and refuses to resume on it."""
    paths = token_files(tmp_path / "data", sizes=(3000, 2500, 4000), vocab=256)
    for p in paths:
        s3_server.client().upload_file(str(p), s3server.BUCKET, f"changing/{p.name}")
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path / "runs")}, "train": {"max_steps": 400},
        "checkpoint": {"every_steps": 2},
        "data": {"kind": "tokens", "vocab_size": 256, "cache_dir": str(tmp_path / "cache"),
                 "num_workers": 1, "path": f"s3://{s3server.BUCKET}/changing/*.bin"}}))
    run = HeldRun(s3_server, tmp_path, config, 3)
    try:
        run.held()
        s3_server.client().put_object(Bucket=s3server.BUCKET, Key="changing/part-01.bin",
                                      Body=bytes(reversed(paths[1].read_bytes())))
        for copy in (tmp_path / "cache").glob("*-part-01.bin"):
            copy.unlink()
        code = run.go()
    finally:
        run.kill()
    stderr = run.text()
    line = stderr.strip().splitlines()[-1]
    assert code == 2, stderr[-3000:]
    assert line.startswith("error: ") and "s3://ckpt/changing/part-01.bin: changed in the " \
        "store since the run listed it" in line, line
    assert "restarting" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert "all_gather_into_tensor" not in stderr  # torch 2.13 deprecates that name
    again = entry("train", str(config), "distributed.nproc_per_node=2", cwd=ROOT,
                  env=s3_server.env(), timeout=240)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "data.path: differs from the data the run being resumed trained on" in \
        again.stderr.strip().splitlines()[-1]

