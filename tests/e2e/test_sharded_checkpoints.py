"""Sharded checkpoints (checkpoint.format sharded, the default for fsdp): each rank writes
its own shards under the same integrity protocol, and a checkpoint resumes at any world
size and under any strategy, continuing the losses of the uninterrupted run; a damaged
shard makes resume fall back; kill -9 of a rank mid-save leaves a whole checkpoint; an
export consolidates the shards into the full weights.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.harness.procs import alive
from tests.harness.runs import (
    ROOT,
    TINY_GPT,
    limit,
    losses,
    merge,
    run_train,
    worker_env,
    write_config,
)
from train.checkpoint import Checkpointer, sharded
from train.core.run import rundir

STEPS = 8


def _config(tmp_path: Path, **extra) -> Path:
    tree = merge(TINY_GPT, {"output": {"dir": str(tmp_path)}, "train": {"max_steps": STEPS},
                            "model": {"depth": 2}, "checkpoint": {"every_steps": 4},
                            "distributed": {"strategy": "fsdp"}, **extra})
    return write_config(tmp_path / "c.yaml", tree)


def _assert_close(got: dict, want: dict, rel: float = 1e-5) -> None:
    assert sorted(got) == sorted(want)
    for step in got:
        assert math.isclose(got[step], want[step], rel_tol=rel), (step, got[step], want[step])


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """An uninterrupted FSDP run of two processes, sharded checkpoints at steps 4 and 8."""
    tmp = tmp_path_factory.mktemp("sharded")
    done = run_train(_config(tmp), "run.name=ref", nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "ref"


def _from_step_4(run: Path, target: Path) -> None:
    """A copy of the run's step-4 checkpoint as the newest of another run."""
    (target / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / "step-4", target / "checkpoints" / "step-4")
    (target / "checkpoints" / "latest").write_text("step-4\n")


def test_each_rank_writes_its_own_shards_listed_in_the_checksums(fsdp_run):
    step = fsdp_run / "checkpoints" / "step-8"
    names = sorted(p.name for p in (step / "model").iterdir())
    # each rank's own shards, and the small files of values DCP keeps once for every rank
    assert names[:2] == [".metadata", "__0_0.distcp"] and "__1_0.distcp" in names
    assert set(names) <= {".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp",
                          "__1_1.distcp"}
    shared = torch.load(step / "state.pt", weights_only=True)
    assert shared["format"] == "sharded" and shared["model"] is None
    assert shared["optimizer"] is None  # nothing was gathered on rank 0
    sums = json.loads((step / "checksums.json").read_text())
    assert set(sums) == {"state.pt", "rank-0.pt", "rank-1.pt", *(f"model/{n}" for n in names)}
    assert Checkpointer.verify(step) is None


@pytest.mark.parametrize("strategy, nproc", [("fsdp", 1), ("fsdp", 4), ("ddp", 2),
                                             ("single", 1)])
def test_a_sharded_checkpoint_resumes_at_any_world_size_and_strategy(fsdp_run, tmp_path,
                                                                     strategy, nproc):
    """Saved by FSDP at 2 processes; resumed at step 4 and trained on, the losses are
    those of the uninterrupted run (up to reduction order)."""
    _from_step_4(fsdp_run, tmp_path / "again")
    done = run_train(_config(tmp_path), "run.name=again", f"distributed.strategy={strategy}",
                     nproc=nproc)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"at step 4, sample 32 (saved with world size 2, now {nproc})" in done.stderr
    want = {s: v for s, v in losses(fsdp_run).items() if s > 4}
    _assert_close(losses(tmp_path / "again"), want)


def test_a_damaged_shard_makes_resume_fall_back_naming_it(fsdp_run, tmp_path):
    run = tmp_path / "damaged"
    shutil.copytree(fsdp_run / "checkpoints", run / "checkpoints")
    shard = run / "checkpoints" / "step-8" / "model" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    done = run_train(_config(tmp_path), "run.name=damaged", "train.max_steps=10", nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "is unusable" in line]
    assert len(warned) == 1 and "step-8" in warned[0], done.stderr[-3000:]
    assert "model/__1_0.distcp does not match its checksum" in warned[0]
    assert "resumed from" in done.stderr and "at step 4" in done.stderr


def test_export_consolidates_the_shards_into_the_full_weights(fsdp_run, tmp_path):
    """The same run with full checkpoints (rank 0 gathers) exports the same weights."""
    full = run_train(_config(tmp_path), "run.name=full", "checkpoint.format=full", nproc=2)
    assert full.returncode == 0, full.stderr[-3000:]
    for run, out in ((fsdp_run, tmp_path / "from-shards"), (tmp_path / "full",
                                                            tmp_path / "from-full")):
        done = subprocess.run([sys.executable, str(ROOT / "entrypoint.py"), "export", str(run),
                               "--out", str(out)], cwd=ROOT, env=worker_env(),
                              capture_output=True, text=True, timeout=limit(300))
        assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    a = torch.load(tmp_path / "from-shards" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "from-full" / "model.pt", weights_only=True)
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-6, atol=0), name
    from train.export import load_model
    loaded = load_model(tmp_path / "from-shards").state_dict()  # what users load: unchanged
    assert sorted(loaded) == sorted(a)
    assert all(torch.equal(loaded[name], a[name]) for name in a)


KILLED_WRITER = """\
import os, sys, torch, torch.distributed as dist
from pathlib import Path
from train.checkpoint import Checkpointer, sharded
dist.init_process_group("gloo")
rank = dist.get_rank()
Path(sys.argv[2], f"pid-{rank}").write_text(str(os.getpid()))
gather = lambda v: (dist.all_gather_object(out := [None] * dist.get_world_size(), v), out)[1]
ck = Checkpointer(Path(sys.argv[1]), rank=rank, keep_last=2, world_size=2,
                  barrier=dist.barrier, gather=gather)
step = 0
while True:
    step += 1
    blob = {"model": {f"w{rank}": torch.full((2_000_000,), float(step))}}  # 8 MB a rank
    ck.save(step, {"step": step, "format": "sharded", "model": None}, {"rank": rank},
            shards=lambda folder: sharded.save(blob, folder))
    if rank == 0:
        print(step, flush=True)
"""


def _kill(pid: int) -> None:
    """SIGKILL a rank (torchrun's child, not ours) and wait until it is gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + limit(30)
    while time.monotonic() < deadline:
        if not alive(pid):  # reaped, or dead and waiting for torchrun to reap it
            return
        time.sleep(0.02)


def test_kill_9_of_one_rank_mid_save_leaves_a_whole_checkpoint(tmp_path):
    """One rank SIGKILLed at random moments of a save loop (the other is then stopped
    too): the newest checkpoint found is always whole, every rank's shard of one step."""
    rng = random.Random(0)
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    run = tmp_path / "run"
    for attempt in range(6):  # the seed's victims: both ranks, early and late in a save
        pids = tmp_path / f"pids-{attempt}"
        pids.mkdir()
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node=2", str(script), str(run), str(pids)],
                                cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, text=True)
        ranks = []
        try:
            proc.stdout.readline()  # at least one checkpoint exists
            ranks = [int((pids / f"pid-{r}").read_text()) for r in range(2)]
            time.sleep(rng.uniform(0.0, 0.6))
            victim = rng.randrange(2)
            for pid in (ranks[victim], ranks[1 - victim]):  # the victim, then its peer
                _kill(pid)
        finally:
            for pid in ranks:
                _kill(pid)
            proc.kill()
            proc.wait()
            proc.stdout.close()
        found = Checkpointer(run, rank=0, keep_last=2).newest_loadable(rank=0)
        assert found is not None, f"attempt {attempt}: nothing loadable"
        path, shared, _ = found
        weights = sharded.full_model_state(path / rundir.SHARDS)
        assert sorted(weights) == ["w0", "w1"], path
        assert all(torch.all(w == float(shared["step"])) for w in weights.values()), path


def test_background_shard_writes_make_the_same_checkpoints(fsdp_run, tmp_path):
    """checkpoint.async_save: the shards are staged to CPU memory and written while training
    goes on; the run and its checkpoints are those of the foreground run."""
    done = run_train(_config(tmp_path), "run.name=bg", "checkpoint.async_save=true", nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_close(losses(tmp_path / "bg"), losses(fsdp_run), rel=0)
    for step in (4, 8):
        folder = tmp_path / "bg" / "checkpoints" / f"step-{step}"
        assert Checkpointer.verify(folder) is None
        assert "model/__1_0.distcp" in json.loads((folder / "checksums.json").read_text())
        got = sharded.full_model_state(folder / rundir.SHARDS)
        want = sharded.full_model_state(fsdp_run / "checkpoints" / f"step-{step}" /
                                        rundir.SHARDS)
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want), step


def test_a_stop_waits_for_the_background_write_and_exits_143_with_it_sealed(tmp_path):
    config = _config(tmp_path, checkpoint={"every_steps": 2, "async_save": True, "keep_last": 50})
    proc = subprocess.Popen([sys.executable, str(ROOT / "entrypoint.py"), "train", str(config),
                             "run.name=stop", "train.max_steps=100000",
                             "distributed.nproc_per_node=2"], cwd=ROOT, env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "checkpoint writing" in line and "step-6" in line:
                break  # a background write was just handed to the writers
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=limit(180))[0]
    finally:
        proc.kill()
    assert proc.returncode == 143, out[-3000:]
    folder = tmp_path / "stop" / "checkpoints"
    steps = sorted(p.name for p in folder.iterdir() if p.name.startswith("step-"))
    assert not [s for s in steps if s.endswith(".partial")], steps
    assert all(Checkpointer.verify(folder / s) is None for s in steps), steps
    last = (folder / "latest").read_text().strip()
    assert last == max(steps, key=lambda s: int(s.split("-")[1]))
    assert int(last.split("-")[1]) >= 6
