"""The checkpoint seam: the storage under the store, the formats chosen once, and one
write path whatever the ranks agree through (a real store writing real files)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from train.checkpoint import Checkpointer, formats, reader
from train.checkpoint.serializer import _latest_size, write_error
from train.checkpoint.state import Restored
from train.core.config import load_config
from train.core.run import rundir
from train.core.storage.local import LocalStorage
from train.core.storage.seam import Storage


def test_a_write_is_durable_and_its_hash_is_that_of_the_bytes_on_disk(tmp_path):
    storage = LocalStorage(tmp_path)
    digest = storage.write("a/b/state.pt", lambda f: torch.save({"w": torch.ones(1000)}, f))
    on_disk = (tmp_path / "a" / "b" / "state.pt").read_bytes()
    assert digest == hashlib.sha256(on_disk).hexdigest() == storage.digest("a/b/state.pt")
    assert torch.equal(torch.load(storage.open("a/b/state.pt"), weights_only=True)["w"],
                       torch.ones(1000))


def test_no_write_goes_through_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    storage = LocalStorage(tmp_path / "run")
    (tmp_path / "run").mkdir()
    os.symlink(victim, tmp_path / "run" / "latest")
    storage.replace("latest", b"step-3\n")
    (tmp_path / "run" / "state.pt").symlink_to(victim)
    storage.write("state.pt", lambda f: f.write(b"new"))
    assert victim.read_text() == "keep me"
    assert (tmp_path / "run" / "latest").read_text() == "step-3\n"
    assert not (tmp_path / "run" / "latest").is_symlink()
    assert (tmp_path / "run" / "state.pt").read_bytes() == b"new"


def test_a_sharded_checkpoints_size_counts_its_shards(tmp_path):
    """A full disk's message says how much a checkpoint takes: the newest one's files,
    its shards in model/ included (a sharded save once said "about 0.0 MiB")."""
    step = tmp_path / rundir.CHECKPOINTS / rundir.step_name(4)
    (step / rundir.SHARDS).mkdir(parents=True)
    sizes = {step / rundir.STATE_FILE: 3000, step / rundir.CHECKSUMS: 200,
             step / rundir.SHARDS / "__0_0.distcp": 6 << 20,
             step / rundir.SHARDS / "__1_0.distcp": 6 << 20,
             step / rundir.SHARDS / ".metadata": 5000}
    for path, size in sizes.items():
        path.write_bytes(b"x" * size)
    (step / rundir.SHARDS / "elsewhere").symlink_to(tmp_path / "big")  # links: not followed
    (tmp_path / "big").write_bytes(b"x" * (1 << 20))
    (tmp_path / rundir.CHECKPOINTS / rundir.LATEST).write_text(rundir.step_name(4))
    storage = LocalStorage(tmp_path)
    assert storage.size(f"{rundir.CHECKPOINTS}/{rundir.step_name(4)}") == sum(sizes.values())
    assert _latest_size(storage) == sum(sizes.values())
    line = str(write_error(OSError(28, "No space left on device"), step.with_name("step-8") /
                           rundir.STATE_FILE, _latest_size(storage)))
    assert "a checkpoint takes about 12 MiB" in line, line


def test_the_local_storage_provides_every_operation_of_the_seam():
    wanted = {name for name in vars(Storage) if not name.startswith("_")}
    assert wanted == {"write", "replace", "open", "digest", "names", "exists", "delete"}
    assert all(callable(getattr(LocalStorage, name, None)) for name in wanted)


def _state(step: int) -> tuple[dict, dict]:
    torch.manual_seed(step)
    return ({"step": step, "model": {"w": torch.randn(64, 64)}, "format": "full"},
            {"rng": torch.get_rng_state(), "rank": 0})


def _saved(run: Path, step: int) -> tuple[dict, dict]:
    folder = run / rundir.CHECKPOINTS / rundir.step_name(step)
    sums = json.loads((folder / rundir.CHECKSUMS).read_text())
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return sums, {"files": files}


def test_a_background_save_writes_what_a_foreground_save_writes(tmp_path):
    """One write path: only how the ranks agree differs (collectives or markers)."""
    for mode in ("foreground", "background"):
        ck = Checkpointer(tmp_path / mode, rank=0, keep_last=2)
        ck.save(3, *_state(3), background=mode == "background")
        ck.wait()
    fore, back = _saved(tmp_path / "foreground", 3), _saved(tmp_path / "background", 3)
    assert fore == back
    assert set(fore[0]) == {rundir.STATE_FILE, rundir.rank_file(0)}  # no marker left
    for mode in ("foreground", "background"):
        path, shared, mine = Checkpointer(tmp_path / mode, rank=0, keep_last=2) \
            .newest_loadable(0)
        assert reader.verify(path) is None and shared["step"] == 3 and mine["rank"] == 0


def test_the_hash_recorded_is_checked_on_load(tmp_path):
    ck = Checkpointer(tmp_path, rank=0, keep_last=3)
    for step in (1, 2):
        ck.save(step, *_state(step))
    newest = tmp_path / rundir.CHECKPOINTS / rundir.step_name(2) / rundir.rank_file(0)
    newest.write_bytes(newest.read_bytes()[:-1] + b"x")  # one flipped byte
    assert reader.verify(newest.parent) == f"{rundir.rank_file(0)} does not match its checksum"
    assert ck.newest_loadable(0)[1]["step"] == 1


def test_the_format_is_chosen_once_from_the_config_and_read_from_the_checkpoint(tmp_path):
    base = tmp_path / "c.yaml"
    base.write_text("model: {kind: mlp}\ndata: {kind: synthetic}\n")
    fsdp = load_config(base, ["distributed.strategy=fsdp", "device=cpu"])
    assert formats.for_config(load_config(base, [])).name == "full"
    assert formats.for_config(fsdp).name == ("sharded" if fsdp.sharded_checkpoints else "full")
    assert formats.of_checkpoint(Restored({"format": "sharded"})).name == "sharded"
    assert formats.of_checkpoint(Restored({})).name == "full"  # written before the field
