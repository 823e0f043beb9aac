"""A job of two nodes whose run directories are node-local (each simulated node its own
folder, tests/harness/multinode.py) with ``checkpoint.remote`` on a real S3 server
(SeaweedFS, tests/harness/s3server.py): FSDP's sharded checkpoints, written in the
background, each node uploading its own part and rank 0 sealing them in the store. Both
nodes then start again with empty run directories and resume from the store bitwise as the
uninterrupted run went on, each node fetching only its own rank's files and shards. The
seal's rules in process: tests/unit/test_node_local.py. Skips without boto3 and weed
(``make s3``)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from launcher.detection.system import free_port
from tests.harness import s3server
from tests.harness.multinode import Process, pid_namespaces
from tests.harness.runs import ENTRY, TINY_GPT, clean_env, losses, merge, write_config

pytestmark = pytest.mark.skipif(s3server.missing() is not None,
                                reason=str(s3server.missing()))
STEPS = 4
PREFIX = "nodes"


def job(tmp_path: Path, server, start: int) -> list[Process]:
    """Two nodes of one process each (world size 2: FSDP shards across the nodes), the
    Kubeflow convention, each node with its own run directory, started."""
    port, namespaces = free_port(), pid_namespaces()
    nodes = []
    for rank in (0, 1):
        config = write_config(tmp_path / f"node{rank}.yaml", merge(TINY_GPT, {
            "output": {"dir": str(tmp_path / f"node{rank}")}, "run": {"name": "r"},
            "model": {"dropout": 0.1}, "train": {"max_steps": STEPS},
            "distributed": {"strategy": "fsdp", "nproc_per_node": 1},
            "checkpoint": {"every_steps": 2, "keep_last": 2, "async_save": True,
                           "remote": f"s3://{s3server.BUCKET}/{PREFIX}"}}))
        env = clean_env(**server.env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        WORLD_SIZE="2", RANK=str(rank))
        nodes.append(Process(f"node{rank}-{start}", [sys.executable, ENTRY, "train",
                                                      str(config)], env, tmp_path,
                             cpus={rank % 2}, namespace=namespaces).start())
    return nodes


def finished(nodes: list[Process]) -> list[int]:
    try:
        return [n.wait(240) for n in nodes]
    finally:
        for n in nodes:
            n.kill()


def shards(run: Path) -> dict[str, bytes]:
    step = run / "checkpoints" / f"step-{STEPS}" / "model"
    return {p.name: p.read_bytes() for p in step.glob("*.distcp")}


def held(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def stored(server, key: str) -> bytes:
    return server.client().get_object(Bucket=s3server.BUCKET,
                                      Key=f"{PREFIX}/r/{key}")["Body"].read()


def test_nodes_with_empty_run_directories_resume_from_the_store_bitwise(s3_server, tmp_path):
    """Each node keeps its own part locally (node 1 never holds state.pt); the store's
    checksums.json lists both nodes' files. With both run directories gone and the newer
    remote checkpoints too, the job resumes from step-2 and
    logs the uninterrupted run's losses and writes its final shards bitwise. Each node
    fetched only what its rank reads: the shared state, its own rank file and shards."""
    codes = finished(job(tmp_path, s3_server, 1))
    text = lambda nodes: "\n=====\n".join(n.text()[-3000:] for n in nodes)  # noqa: E731
    assert codes == [0, 0], text([])
    node0, node1 = tmp_path / "node0" / "r", tmp_path / "node1" / "r"
    local = node1 / "checkpoints" / f"step-{STEPS}"
    assert not (local / "state.pt").exists() and (local / "model" / "__1_0.distcp").is_file()
    sums = json.loads(stored(s3_server, f"checkpoints/step-{STEPS}/checksums.json"))
    assert {"state.pt", "rank-0.pt", "rank-1.pt", "model/.metadata", "model/__0_0.distcp",
            "model/__1_0.distcp"} <= set(sums)
    reference, final = losses(node0), {**shards(node0), **shards(node1)}
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(final)

    shutil.rmtree(tmp_path / "node0")
    shutil.rmtree(tmp_path / "node1")
    s3 = s3_server.client()
    for step in (4,):  # only step-2 is left to resume, latest still names step-4
        listed = s3.list_objects_v2(Bucket=s3server.BUCKET,
                                    Prefix=f"{PREFIX}/r/checkpoints/step-{step}/")
        for o in listed.get("Contents", []):
            s3.delete_object(Bucket=s3server.BUCKET, Key=o["Key"])
    nodes = job(tmp_path, s3_server, 2)
    codes = finished(nodes)
    assert codes == [0, 0], text(nodes)
    # each node fetched what its rank reads: the shared state, its rank file, the index,
    # its own shards (the same world size and strategy) and the small files of values DCP
    # keeps once for every rank (__R_1), never the other rank's shards
    sums = json.loads(stored(s3_server, "checkpoints/step-2/checksums.json"))
    small = [n for n in sums if n.endswith("_1.distcp")]
    for node, rank in ((node0, 0), (node1, 1)):
        fetched = node / "checkpoints" / "step-2"
        assert held(fetched) == sorted([".node-part", "checksums.json", "model/.metadata",
                                        f"model/__{rank}_0.distcp", *small,
                                        f"rank-{rank}.pt", "state.pt"])
    said = nodes[0].text()
    assert f"fetched checkpoint step-2 from s3://{s3server.BUCKET}/{PREFIX}/r" in said
    assert "at step 2, sample 16 (saved with world size 2, now 2)" in said
    got = losses(node0)
    assert [got[s] for s in range(3, STEPS + 1)] == [reference[s] for s in range(3, STEPS + 1)]
    assert {**shards(node0), **shards(node1)} == final
