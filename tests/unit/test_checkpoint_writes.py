"""How a checkpoint file reaches the disk (train.core.bulk): whatever the sizes and the
pattern of the writes, the file holds exactly the bytes written and the hash returned is
theirs; a write the disk refuses is an error in the caller, with nothing left running."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from tests.harness.runs import ROOT
from train.checkpoint import sharded
from train.checkpoint.serializer import save_file
from train.core import bulk
from train.core.files import sha256_file

CHUNK = bulk.CHUNK
# the last: every chunk of the pipeline goes round twice (a chunk not handed back
# by the hashing or the writing thread would stop the writes)
SIZES = [0, 1, CHUNK - 1, CHUNK, bulk.INLINE + 1, 5 * CHUNK + 4095,
         bulk.INLINE + 2 * bulk.DEPTH * CHUNK + 7]


@pytest.fixture
def folders(tmp_path: Path):
    """The test's disk, and memory (tmpfs: O_DIRECT refused or taken depending on the
    kernel) where the machine has it."""
    found = [tmp_path]
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        found.append(Path(tempfile.mkdtemp(dir=shm, prefix="test-bulk-")))
    yield found
    for folder in found[1:]:
        shutil.rmtree(folder, ignore_errors=True)


def _write_in_pieces(f: bulk.BulkFile, data: bytes, rng: random.Random) -> None:
    view, done = memoryview(data), 0
    while done < len(data):
        size = rng.choice([1, 64, 4096, 100_000, CHUNK + 3, 3 * CHUNK])
        assert f.write(view[done:done + size]) == len(view[done:done + size])
        done += size
        assert f.tell() == min(done, len(data))


@pytest.mark.parametrize("size", SIZES)
def test_a_file_holds_exactly_what_was_written_and_its_hash_is_theirs(folders, size):
    rng = random.Random(size)
    data = rng.randbytes(size)
    for folder in folders:
        for pieces in (False, True):
            path = folder / f"f-{pieces}"
            with bulk.BulkFile(path) as f:
                _write_in_pieces(f, data, rng) if pieces else f.write(data)
            assert path.read_bytes() == data
            assert f.digest == hashlib.sha256(data).hexdigest() == sha256_file(path)
    assert not [t for t in threading.enumerate() if t.name.startswith("bulk-")]
    assert len(bulk._IDLE) <= bulk.DEPTH


def test_a_link_at_the_name_is_replaced_and_what_it_points_at_is_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (tmp_path / "state.pt").symlink_to(victim)
    with bulk.BulkFile(tmp_path / "state.pt") as f:
        f.write(os.urandom(3 * CHUNK))
    assert victim.read_bytes() == b"keep me"
    assert not (tmp_path / "state.pt").is_symlink()
    assert sha256_file(tmp_path / "state.pt") == f.digest


def test_a_failure_while_filling_stops_the_threads_and_is_the_callers(tmp_path):
    with pytest.raises(ValueError, match="half way"), bulk.BulkFile(tmp_path / "x") as f:
        f.write(os.urandom(6 * CHUNK))  # the pipeline runs
        raise ValueError("half way")
    assert f.digest is None
    assert not [t for t in threading.enumerate() if t.name.startswith("bulk-")]


REFUSED = """
import errno, os, resource, signal, sys
from pathlib import Path
from train.core import bulk
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit: EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (5 * bulk.CHUNK, 5 * bulk.CHUNK))
try:
    with bulk.BulkFile(Path(sys.argv[1])) as f:
        for _ in range(12):
            f.write(os.urandom(bulk.CHUNK))
except OSError as exc:
    print("refused", errno.errorcode[exc.errno])
    sys.exit(0)
print("written", f.digest)
"""


def test_a_write_the_disk_refuses_is_raised_in_the_caller(tmp_path):
    """A file size limit (RLIMIT_FSIZE) makes the kernel refuse the writes past it, as
    a full disk would: the error reaches the caller's write or close."""
    proc = subprocess.run([sys.executable, "-c", REFUSED, str(tmp_path / "big")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["refused", "EFBIG"]


def test_a_checkpoint_file_loads_with_torch_load_and_leaves_torch_settings_alone(tmp_path):
    state = {"w": torch.randn(3 * CHUNK // 4), "step": 7}
    digest = save_file(state, tmp_path / "state.pt")
    assert digest == sha256_file(tmp_path / "state.pt")
    back = torch.load(tmp_path / "state.pt", weights_only=True)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 7
    assert torch.serialization.get_crc32_options() is True


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_shards_are_hashed_as_written_and_load_back(tmp_path):
    state = {"model": {"w": torch.randn(2 * CHUNK // 4 + 5)}, "optimizer": {"n": torch.arange(9)}}
    written = sharded.save(state, tmp_path)
    assert {p.name for p in written} == {"__0_0.distcp", ".metadata"}
    assert all(digest == sha256_file(path) for path, digest in written.items())
    import torch.distributed.checkpoint as dcp
    back = {"model": {"w": torch.empty_like(state["model"]["w"])},
            "optimizer": {"n": torch.empty(9, dtype=torch.long)}}
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert torch.equal(back["optimizer"]["n"], state["optimizer"]["n"])
