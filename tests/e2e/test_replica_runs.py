"""Training in replica groups (``distributed.fault_tolerance: replicas``) for real:
``entrypoint.py train`` starts torchft's Lighthouse and one torchrun per group on
127.0.0.1, the workers meet in torchft's Manager and train a fixed global batch.

A worker of group 1 killed with SIGKILL mid-run: its torchrun restarts it, it heals from
a live peer, and meanwhile the other groups train on in the same processes. The
properties: the survivors' PIDs never change, ``ledger.jsonl`` lists every sample of
the run exactly once, and the final weights are those of the fault-free run, with a
spare (it takes the lost group's slot) and without one (the survivor accumulates the
lost slot, one micro-batch a slot here, so the sums are the same sums; or, as torchft's
Lighthouse wants more than half of the groups it still hears from for a quorum, it
waits out the dead group's heartbeat and, when torchrun restarted the group as fast,
trains on with it).
The launcher's side alone: tests/e2e/test_replica_launch.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher.detection.torchft_tools import lighthouse_binary
from tests.harness import procs
from tests.harness.runs import ENTRY, clean_env, limit, wait_for, write_config
from train.observe.ledger import check_exactly_once, read

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None or lighthouse_binary() is None,
    reason="needs torchft and its torchft_lighthouse (make ft)")

STEPS = 1500  # long enough that a kill at step 20 lands mid-run on any machine


def config(tmp_path: Path, name: str) -> Path:
    return write_config(tmp_path / f"{name}.yaml", {
        "run": {"name": name}, "output": {"dir": str(tmp_path / "runs")},
        "model": {"kind": "mlp"}, "data": {"kind": "synthetic"},
        "train": {"max_steps": STEPS, "global_batch_size": 16},
        "logging": {"every_steps": 500}, "checkpoint": {"every_steps": 500},
        "distributed": {"fault_tolerance": "replicas", "replicas": 2, "max_restarts": 3}})


def start(cfg: Path, *overrides: str) -> tuple[subprocess.Popen, Path]:
    err = cfg.with_suffix(".err")
    proc = subprocess.Popen([sys.executable, ENTRY, "train", str(cfg), *overrides],
                            cwd=cfg.parent, env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=err.open("w"))
    return proc, err


def ledger_lines(run_dir: Path) -> int:
    return len(read(run_dir / "ledger.jsonl"))


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    state = run_dir / "checkpoints" / f"step-{STEPS}" / "state.pt"
    return torch.load(state, weights_only=True)["model"]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> Path:
    """The run every faulty one is compared with: 2 groups and a spare, no fault."""
    tmp = tmp_path_factory.mktemp("fault-free")
    proc, err = start(config(tmp, "ref"), "distributed.spares=1")
    assert proc.wait(timeout=limit(600)) == 0, err.read_text()
    return tmp / "runs" / "ref"


@pytest.mark.parametrize("spares", [1, 0])
def test_a_killed_worker_costs_no_restart_of_the_others_and_no_sample(tmp_path, fault_free,
                                                                      spares):
    cfg = config(tmp_path, "faulty")
    run_dir = tmp_path / "runs" / "faulty"
    proc, err = start(cfg, f"distributed.spares={spares}")
    try:
        wait_for(lambda: ledger_lines(run_dir) >= 20, limit(300), "20 committed steps")
        before = procs.replica_workers(proc.pid)
        assert sorted(before) == list(range(2 + spares))
        subprocess.run(["kill", "-9", str(before[1])], check=True)
        at_kill = ledger_lines(run_dir)
        wait_for(lambda: ledger_lines(run_dir) >= at_kill + 20, limit(300),
                 "20 more committed steps after the kill")
        after = procs.replica_workers(proc.pid)
        survivors = [g for g in before if g != 1]
        assert all(after.get(g) == before[g] for g in survivors), (before, after)
        assert proc.wait(timeout=limit(600)) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert "torchrun (replica group 1): rank 0 killed by SIGKILL" in text, text
    entries = read(run_dir / "ledger.jsonl")
    assert [e.step for e in entries] == list(range(1, STEPS + 1))
    assert check_exactly_once(entries) == []
    if spares:  # two groups of three live: a quorum at once, the spare in slot 1
        assert (0, 2) in {tuple(e.replicas) for e in entries}
    mine, reference = final_weights(run_dir), final_weights(fault_free)
    assert all(torch.equal(mine[k], reference[k]) for k in reference)
    result = json.loads((run_dir / "result.json").read_text())
    assert result == json.loads((fault_free / "result.json").read_text())
