"""Node-local run directories with ``checkpoint.remote``: each node's tier uploads its
part of a checkpoint and a marker, rank 0's seals the checkpoint in the store only when
every node's part of that save is there and agrees; ``latest`` never moves backwards; a
node fetches a sealed checkpoint whole, keeping the files it already holds. Against a
real S3 server (SeaweedFS on 127.0.0.1). Whole jobs of two nodes:
tests/e2e/test_node_local_runs.py. Skips without boto3 and weed (``make s3``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.harness import s3server
from train.core.storage.local import LocalStorage

BUCKET = s3server.BUCKET


def part(run: Path, step: int, files: dict[str, bytes]) -> dict[str, str]:
    """A node's locally sealed part of ``step``: its files and their checksums.json."""
    folder = run / "checkpoints" / f"step-{step}"
    sums = {}
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
        sums[name] = hashlib.sha256(data).hexdigest()
    (folder / "checksums.json").write_text(json.dumps(sums))
    return sums


def node_tier(tmp_path: Path, prefix: str, node: int, local: str | None = None):
    from train.checkpoint.listing import Nodes
    from train.checkpoint.tier import RemoteTier
    return RemoteTier.from_url(f"s3://{BUCKET}/{prefix}", "run",
                               LocalStorage(tmp_path / (local or f"node{node}")), keep_last=2,
                               nodes=Nodes(node, (0, 1), parts_timeout_s=1))


def two_parts(tmp_path: Path, step: int) -> tuple[dict, dict]:
    zero = part(tmp_path / "node0", step, {"state.pt": b"s" * 10, "rank-0.pt": b"a" * step,
                                           "model/__0_0.distcp": b"x" * 99})
    one = part(tmp_path / "node1", step, {"rank-1.pt": b"b" * step,
                                          "model/__1_0.distcp": b"y" * 77})
    return zero, one


def test_a_checkpoint_is_sealed_remotely_only_once_every_nodes_part_is_there(aws, tmp_path):
    from train.checkpoint.listing import RemoteError
    zero, one = two_parts(tmp_path, 2)
    tier0, tier1 = node_tier(tmp_path, "seal", 0), node_tier(tmp_path, "seal", 1)
    with pytest.raises(RemoteError, match="not every node's part of step-2"):
        tier0.uploader.mirror(2, "save-a", {**zero, **one})  # node 1's part is missing
    assert not tier0.remote.exists("checkpoints/step-2/checksums.json")
    assert tier0.listing.latest() == (None, None)

    tier1.uploader.mirror(2, "save-b")  # another save's part of the same step: not this one's
    assert tier0.listing.parts(2, "save-a", None) is None
    tier1.uploader.mirror(2, "save-a")
    assert not tier1.remote.exists("checkpoints/step-2/checksums.json")  # node 1 never seals
    tier0.uploader.mirror(2, "save-a", {**zero, **one})
    sealed = json.loads(tier0.remote.read("checkpoints/step-2/checksums.json")[0])
    assert sealed == {**zero, **one} and tier0.listing.latest()[0] == 2
    assert tier0.listing.sealed_steps() == [2]


def test_parts_that_disagree_with_what_the_ranks_wrote_are_never_sealed(aws, tmp_path):
    from train.checkpoint.listing import RemoteError
    zero, one = two_parts(tmp_path, 2)
    tier0, tier1 = node_tier(tmp_path, "mismatch", 0), node_tier(tmp_path, "mismatch", 1)
    tier1.uploader.mirror(2, "t")
    wrong = {**zero, **one, "rank-1.pt": "0" * 64}
    with pytest.raises(RemoteError, match="do not list the files and checksums"):
        tier0.uploader.mirror(2, "t", wrong)
    with pytest.raises(RemoteError, match="do not list"):
        tier0.listing.parts(2, "t", {**zero})  # a file the ranks wrote is missing from the parts
    assert not tier0.remote.exists("checkpoints/step-2/checksums.json")
    assert tier0.listing.latest() == (None, None)


def test_latest_never_moves_backwards_and_a_node_fetches_what_it_lacks(aws, tmp_path):
    tier0, tier1 = node_tier(tmp_path, "order", 0), node_tier(tmp_path, "order", 1)
    for step in (2, 4):
        two_parts(tmp_path, step)
        tier1.uploader.mirror(step, f"t{step}")
        tier0.uploader.mirror(step, f"t{step}")  # a background save: no rank checksums to compare
    two_parts(tmp_path, 2)
    tier1.uploader.mirror(2, "again")
    tier0.uploader.mirror(2, "again")  # a stale writer's older step
    assert tier0.listing.latest()[0] == 4 and tier0.listing.sealed_steps() == [4, 2]

    kept = tmp_path / "node1" / "checkpoints" / "step-4" / "model" / "__1_0.distcp"
    inode = kept.stat().st_ino
    assert tier1.fetcher.fetch(4) is None
    folder = tmp_path / "node1" / "checkpoints" / "step-4"
    assert (folder / "state.pt").read_bytes() == b"s" * 10  # node 0's file, downloaded
    assert (folder / "model" / "__1_0.distcp").stat().st_ino == inode  # its own, kept
    from train.checkpoint import reader
    assert reader.verify(folder) is None
    assert not (tmp_path / "node1" / "metrics.jsonl").exists()  # rank 0's node's record


def test_a_node_fetches_what_its_ranks_read_and_seals_only_that(aws, tmp_path):
    """The two halves of a node-local fetch into an empty run directory: first state.pt,
    this node's rank files and the shards' index (verified), then the shard files its
    ranks name; its checksums.json lists what it holds, and it is marked as one node's
    part (a start that finds it alone fetches the whole one, the launcher does not refuse
    it). A shard with a flipped byte in the store fails the second half and leaves
    nothing behind."""
    tier0, tier1 = node_tier(tmp_path, "part", 0), node_tier(tmp_path, "part", 1)
    zero, _ = two_parts(tmp_path, 2)
    part(tmp_path / "node0", 2, {**{n: (tmp_path / "node0" / "checkpoints" / "step-2" / n)
                                   .read_bytes() for n in zero},
                                 "model/.metadata": b"index"})
    tier1.uploader.mirror(2, "t")
    tier0.uploader.mirror(2, "t")
    empty = node_tier(tmp_path, "part", 1, local="fresh").fetcher
    assert empty.fetch_part(2, [1]) is None
    partial = tmp_path / "fresh" / "checkpoints" / "step-2.partial"
    held = lambda folder: sorted(p.relative_to(folder).as_posix()  # noqa: E731
                                 for p in folder.rglob("*") if p.is_file())
    assert held(partial) == ["checksums.json", "model/.metadata", "rank-1.pt", "state.pt"]
    assert empty.fetch_rest(2, {"model/__1_0.distcp"}) is None
    folder = tmp_path / "fresh" / "checkpoints" / "step-2"
    assert held(folder) == [".node-part", "checksums.json", "model/.metadata",
                            "model/__1_0.distcp", "rank-1.pt", "state.pt"]
    from train.checkpoint import reader
    assert not partial.exists()
    (folder / ".node-part").unlink()
    assert reader.verify(folder) is None  # what it holds is whole and verified
    (folder / ".node-part").touch()
    assert "one node's part of a checkpoint" in reader.verify(folder)  # never resumed alone
    from train.core.run import rundir
    assert rundir.usable_problem(folder.parent) is None  # nor refused by the launcher

    data = bytearray(tier0.remote.read("checkpoints/step-2/model/__0_0.distcp")[0])
    data[0] ^= 0xFF
    tier0.remote.replace("checkpoints/step-2/model/__0_0.distcp", bytes(data))
    other = node_tier(tmp_path, "part", 1, local="other").fetcher
    assert other.fetch_part(2, [0]) is None
    assert other.fetch_rest(2, {"model/__0_0.distcp"}) == \
        "model/__0_0.distcp does not match its checksum"
    assert not (tmp_path / "other" / "checkpoints" / "step-2.partial").exists()
    assert not (tmp_path / "other" / "checkpoints" / "step-2").exists()


def test_a_start_that_finds_a_part_alone_fetches_the_whole_checkpoint(aws, tmp_path):
    """A job that shrank to one node (one run directory again) finds on its disk the part
    it kept of the newest checkpoint: that part is no local checkpoint, so the whole one
    comes from the store (its own files kept), and is no longer marked a part."""
    from train.checkpoint.tier import RemoteTier
    zero, one = two_parts(tmp_path, 2)
    tier0, tier1 = node_tier(tmp_path, "shrunk", 0), node_tier(tmp_path, "shrunk", 1)
    tier1.uploader.mirror(2, "t")
    tier0.uploader.mirror(2, "t")
    folder = tmp_path / "node1" / "checkpoints" / "step-2"
    (folder / ".node-part").touch()  # as the node sealed it
    alone = RemoteTier.from_url(f"s3://{BUCKET}/shrunk", "run",
                                LocalStorage(tmp_path / "node1"), keep_last=2)
    assert alone.fetcher.fetch_newer() == 2
    assert json.loads((folder / "checksums.json").read_text()) == {**zero, **one}
    assert not (folder / ".node-part").exists()
    from train.checkpoint import reader
    assert reader.verify(folder) is None
