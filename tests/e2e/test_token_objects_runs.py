"""Token and text files in object storage, whole runs: two processes started by the
launcher read their shards from a real S3 server (SeaweedFS on 127.0.0.1) and train with
the losses of one process reading the same files from the local disk (whose launcher
kept its scan of the files' ids in the run directory); a text run from objects has the
losses of the same run from local files. In process, and one process from the store
resumed: tests/unit/test_token_objects.py, tests/unit/test_text_objects.py. Skips
without boto3 and weed (``make s3``)."""

from __future__ import annotations

import json
import math

import pytest

from tests.harness import s3server
from tests.harness.runs import ROOT, TINY_GPT, entry, losses, merge, write_config
from tests.unit.test_text_objects import text_files
from tests.unit.test_token_shards import token_files

pytestmark = pytest.mark.skipif(s3server.missing() is not None,
                                reason=str(s3server.missing()))
STEPS = 6


def test_two_processes_from_objects_train_as_one_from_local_files(tmp_path):
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
