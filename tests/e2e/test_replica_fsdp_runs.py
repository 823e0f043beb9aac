"""FSDP inside replica groups (``distributed.strategy: fsdp`` with
``distributed.fault_tolerance: replicas``), for real: 2 groups of 2 processes and a spare
group on 127.0.0.1 with gloo, each group one torchrun sharding the model over its 2
ranks, rank r of every group summing its gradient shard with rank r of the others.

One worker of group 1 (its rank 1) killed with SIGKILL after the first sharded
checkpoint, its torchrun held (SIGSTOP) for 20 steps, in which the spare takes the lost
slot; then the others held while torchrun restarts the group, which resumes from that
checkpoint (so that a busy machine cannot finish the run first), and all let go: group 1
heals each rank's shards (model and optimizer state) from a live group's same rank. The
properties: the other groups' PIDs never change, ``ledger.jsonl`` lists every sample
exactly once, and the final weights (read from the sharded checkpoint) are bitwise those
of the fault-free run: the spare's shards' gradients are those group 1's would have been.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher.detection.torchft_tools import lighthouse_binary
from tests.harness import procs
from tests.harness.runs import ENTRY, TINY_MLP, clean_env, limit, merge, wait_for, write_config
from train.checkpoint.sharded import full_model_state
from train.core.run import rundir
from train.observe.ledger import check_exactly_once, read

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None or lighthouse_binary() is None,
    reason="needs torchft and its torchft_lighthouse (make ft)")

# The others are held while group 1 restarts, so its restart costs no steps; after the
# kill (past step 50's checkpoint) 20 steps without it, then its heal at the next quorum
# once all are let go: 400 leaves hundreds of steps to spare (1000 before, the time of a
# second fault-free run).
STEPS = 400


def run(tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path, Path]:
    cfg = write_config(tmp_path / f"{name}.yaml", merge(TINY_MLP, {
        "run": {"name": name}, "output": {"dir": str(tmp_path / "runs")},
        "train": {"max_steps": STEPS}, "logging": {"every_steps": 200},
        "checkpoint": {"every_steps": 50, "keep_last": 1},
        "distributed": {"fault_tolerance": "replicas", "replicas": 2, "spares": 1,
                        "max_restarts": 3, "strategy": "fsdp", "nproc_per_node": 2}}))
    err = cfg.with_suffix(".err")
    proc = subprocess.Popen([sys.executable, ENTRY, "train", str(cfg)], cwd=tmp_path,
                            env=clean_env(), stdout=subprocess.DEVNULL, stderr=err.open("w"))
    return proc, err, tmp_path / "runs" / name


def signal_all(pids: list[int], sig: str) -> None:
    subprocess.run(["kill", sig, *map(str, pids)], check=True)


def ledger_lines(run_dir: Path) -> int:
    return len(read(run_dir / "ledger.jsonl"))


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return full_model_state(run_dir / "checkpoints" / f"step-{STEPS}" / rundir.SHARDS)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> Path:
    proc, err, run_dir = run(tmp_path_factory.mktemp("fault-free"), "ref")
    assert proc.wait(timeout=limit(600)) == 0, err.read_text()[-3000:]
    return run_dir


def test_a_killed_fsdp_worker_heals_its_shards_and_changes_no_weight(tmp_path, fault_free):
    proc, err, run_dir = run(tmp_path, "faulty")
    try:
        sealed = run_dir / "checkpoints" / "step-50" / "checksums.json"
        wait_for(sealed.exists, limit(300), "the checkpoint of step 50")
        before = procs.replica_ranks(proc.pid)
        assert sorted(before) == [(g, r) for g in range(3) for r in range(2)], before
        # 1. group 1's torchrun held while the others train on without it (the spare in
        # its slot); 2. the others held while it restarts the group from the checkpoint
        # (on a busy machine they would otherwise finish the run first); 3. all let go
        survivors = [before[k] for k in before if k[0] != 1]
        agent = procs.parent(before[(1, 1)])
        signal_all([agent], "-STOP")
        try:
            subprocess.run(["kill", "-9", str(before[(1, 1)])], check=True)
            at_kill = ledger_lines(run_dir)
            wait_for(lambda: ledger_lines(run_dir) >= at_kill + 20 or proc.poll() is not None,
                     limit(300), "20 committed steps without group 1")
            signal_all(survivors, "-STOP")
        finally:
            signal_all([agent], "-CONT")
        try:
            wait_for(lambda: re.search(r"\[group1-rank0\].*resumed from", err.read_text())
                     or proc.poll() is not None, limit(300), "group 1 back from its checkpoint")
        finally:
            signal_all(survivors, "-CONT")
        wait_for(lambda: "replica group 1 healed from a live peer at step" in err.read_text()
                 or proc.poll() is not None, limit(300), "group 1's heal")
        after = procs.replica_ranks(proc.pid)
        assert all(after.get(k) == before[k] for k in before if k[0] != 1), (before, after)
        assert proc.wait(timeout=limit(600)) == 0, err.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert "torchrun (replica group 1): rank 1 killed by SIGKILL" in text, text[-3000:]
    healed = re.search(r"\[group1-rank1\].*replica group 1 healed from a live peer at step "
                       r"([1-9]\d*)", text)
    assert healed and int(healed[1]) < STEPS, text[-3000:]  # rank 1's shards, mid-run
    assert re.search(r"\[group1-rank0\].*resumed from \S+/step-\d+", text), text[-3000:]
    entries = read(run_dir / "ledger.jsonl")
    assert [e.step for e in entries] == list(range(1, STEPS + 1))
    assert check_exactly_once(entries) == []
    assert (0, 2) in {tuple(e.replicas) for e in entries}  # the spare took slot 1
    assert (0, 1) in {tuple(e.replicas) for e in entries[int(healed[1]):]}  # group 1 back
    mine, reference = final_weights(run_dir), final_weights(fault_free)
    assert sorted(mine) == sorted(reference)
    assert all(torch.equal(mine[k], reference[k]) for k in reference)
