"""Training in replica groups (``distributed.fault_tolerance: replicas``) for real:
``entrypoint.py train`` starts torchft's Lighthouse and one torchrun per group on
127.0.0.1, the workers meet in torchft's Manager and train a fixed global batch.

A worker of group 1 killed with SIGKILL mid-run, its torchrun held (SIGSTOP) for 20
steps so that the others must go on without it, then let go: it restarts the worker,
which heals from a live peer, while the other groups trained on in the same processes.
The properties: the survivors' PIDs never change, ``ledger.jsonl`` lists every sample of
the run exactly once, and the final weights are those of the fault-free run, with a
spare (it takes the lost group's slot) and without one (the survivor computes the lost
slot too, one micro-batch a slot here, so the sums are the same sums; torchft's
Lighthouse wants more than half of the groups it still hears from for a quorum, so it
first waits out the dead group's heartbeat).
The fault-free run reads its data in the training processes (``data.num_workers: 0``);
the run with a kill and a spare and the run with a freeze have 2 loader workers a
group, which load each step's micro-batches ahead and must follow the faults (a retry
on another slot, a slot taken over, a heal to a step ahead) to the same samples: the
same final weights. The kill without a spare reads in the training processes (fewer
processes on a loaded machine; the survivor's second slot is tests/unit/
test_replica_data.py's). The others take ``auto``.
The launcher's side alone: tests/e2e/test_replica_launch.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
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

STEPS = 1000  # long enough that a kill at step 20 lands mid-run on any machine
EVERY = 250  # checkpoints and log lines


def config(tmp_path: Path, name: str, workers: int | str = "auto") -> Path:
    return write_config(tmp_path / f"{name}.yaml", {
        "run": {"name": name}, "output": {"dir": str(tmp_path / "runs")},
        "model": {"kind": "mlp"}, "data": {"kind": "synthetic", "num_workers": workers},
        "train": {"max_steps": STEPS, "global_batch_size": 16},
        "logging": {"every_steps": EVERY}, "checkpoint": {"every_steps": EVERY},
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
    """The run every faulty one is compared with: 2 groups and a spare, no fault, its data
    read in the training processes."""
    tmp = tmp_path_factory.mktemp("fault-free")
    proc, err = start(config(tmp, "ref", workers=0), "distributed.spares=1")
    assert proc.wait(timeout=limit(600)) == 0, err.read_text()
    return tmp / "runs" / "ref"


@pytest.mark.parametrize("spares", [1, 0])
def test_a_killed_worker_costs_no_restart_of_the_others_and_no_sample(tmp_path, fault_free,
                                                                      spares):
    cfg = config(tmp_path, "faulty", workers=2 if spares else 0)
    run_dir = tmp_path / "runs" / "faulty"
    proc, err = start(cfg, f"distributed.spares={spares}")
    try:
        wait_for(lambda: ledger_lines(run_dir) >= 20, limit(300), "20 committed steps")
        before = procs.replica_workers(proc.pid)
        assert sorted(before) == list(range(2 + spares))
        # group 1's torchrun held while the others train on: torchrun may restart a
        # worker faster than the others notice its loss (then group 1 takes its own slot
        # again and the spare's never had to)
        agent = procs.parent(before[1])
        subprocess.run(["kill", "-STOP", str(agent)], check=True)
        try:
            subprocess.run(["kill", "-9", str(before[1])], check=True)
            at_kill = ledger_lines(run_dir)
            wait_for(lambda: ledger_lines(run_dir) >= at_kill + 20, limit(300),
                     "20 more committed steps after the kill")
        finally:
            subprocess.run(["kill", "-CONT", str(agent)], check=True)
        after = procs.replica_workers(proc.pid)
        survivors = [g for g in before if g != 1]
        assert all(after.get(g) == before[g] for g in survivors), (before, after)
        assert proc.wait(timeout=limit(600)) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert "torchrun (replica group 1): rank 0 killed by SIGKILL" in text, text
    assert f"of {2 + spares} replica groups in the quorum, without replica group 1 " in text
    # the loader workers loaded the steps, and a fault re-pointed them (the restarted
    # group's heal; the spare's slot, or group 0's second)
    served = re.findall(r"data: (\d+) of \d+ micro-batches from 2 loader worker\(s\) .*"
                        r"re-pointed (\d+) time", text)
    if spares:
        assert served and any(int(again) > 0 for _, again in served), text[-3000:]
    entries = read(run_dir / "ledger.jsonl")
    assert [e.step for e in entries] == list(range(1, STEPS + 1))
    assert check_exactly_once(entries) == []
    # without group 1: the spare took its slot, or the survivor computed both
    assert ((0, 2) if spares else (0, 0)) in {tuple(e.replicas) for e in entries}
    mine, reference = final_weights(run_dir), final_weights(fault_free)
    assert all(torch.equal(mine[k], reference[k]) for k in reference)
    result = json.loads((run_dir / "result.json").read_text())
    assert result == json.loads((fault_free / "result.json").read_text())


def test_a_stop_by_signal_checkpoints_once_and_the_rerun_ends_as_the_fault_free_run(
        tmp_path, fault_free):
    """SIGTERM reaches every group; they agree on the step to stop at through the step's
    all-reduce, one group writes the checkpoint, every group exits 143. The same command
    again resumes there, continues the ledger, and ends with the fault-free weights."""
    cfg = config(tmp_path, "stopped")
    run_dir = tmp_path / "runs" / "stopped"
    proc, err = start(cfg, "distributed.spares=1")
    try:
        wait_for(lambda: ledger_lines(run_dir) >= 20, limit(300), "20 committed steps")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=limit(300)) == 143, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped_at = [e.step for e in read(run_dir / "ledger.jsonl")][-1]
    assert stopped_at < STEPS
    assert (run_dir / "checkpoints" / f"step-{stopped_at}" / "checksums.json").is_file()
    again, err = start(cfg, "distributed.spares=1")
    assert again.wait(timeout=limit(600)) == 0, err.read_text()
    assert f"at step {stopped_at}" in err.read_text()
    entries = read(run_dir / "ledger.jsonl")
    assert [e.step for e in entries] == list(range(1, STEPS + 1))
    assert check_exactly_once(entries) == []
    mine, reference = final_weights(run_dir), final_weights(fault_free)
    assert all(torch.equal(mine[k], reference[k]) for k in reference)


def test_a_frozen_group_is_left_behind_and_heals_when_it_thaws(tmp_path, fault_free):
    """SIGSTOP of group 0's worker (the ledger's writer), with the default all-reduce
    timeout (distributed.replica_timeout_s: 60 s): the Lighthouse stops hearing it, the
    others give their step up on that (not on the timeout), the spare takes its slot and
    group 1 writes the ledger; SIGCONT: group 0 finds its step failed, heals from a live
    group and trains on, in the same process, writing the ledger again. Nobody
    restarted; nothing lost or written twice."""
    cfg = config(tmp_path, "frozen", workers=2)
    run_dir = tmp_path / "runs" / "frozen"
    proc, err = start(cfg, "distributed.spares=1")
    try:
        wait_for(lambda: ledger_lines(run_dir) >= 20, limit(300), "20 committed steps")
        before = procs.replica_workers(proc.pid)
        subprocess.run(["kill", "-STOP", str(before[0])], check=True)
        at_stop = ledger_lines(run_dir)
        try:
            wait_for(lambda: ledger_lines(run_dir) >= at_stop + 20, limit(300),
                     "20 committed steps without group 1")
        finally:
            subprocess.run(["kill", "-CONT", str(before[0])], check=True)
        assert proc.wait(timeout=limit(600)) == 0, err.read_text()
        assert "replica group 0 healed from a live peer" in err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "restarting the workers" not in err.read_text()
    assert "replica group 0 in this step's all-reduce is frozen or cut off" in err.read_text()
    entries = read(run_dir / "ledger.jsonl")
    assert check_exactly_once(entries) == [] and entries[-1].step == STEPS
    assert (1, 2) in {tuple(e.replicas) for e in entries}
    mine, reference = final_weights(run_dir), final_weights(fault_free)
    assert all(torch.equal(mine[k], reference[k]) for k in reference)


def test_a_lost_lighthouse_falls_back_to_the_last_checkpoint(tmp_path, fault_free):
    """kill -9 of the Lighthouse: one line names it, every group stops and starts again
    with a new one from the last sealed checkpoint; the ledger drops the steps trained
    again, and the run ends as the fault-free one."""
    cfg = config(tmp_path, "lost")
    run_dir = tmp_path / "runs" / "lost"
    proc, err = start(cfg, "distributed.spares=1")
    try:
        first = run_dir / "checkpoints" / f"step-{EVERY}" / "checksums.json"
        wait_for(first.exists, limit(300), f"the checkpoint of step {EVERY}")
        lighthouse = int(re.search(r"\(the Lighthouse, pid (\d+);", err.read_text())[1])
        subprocess.run(["kill", "-9", str(lighthouse)], check=True)
        assert proc.wait(timeout=limit(600)) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert len([ln for ln in text.splitlines() if f"the Lighthouse (pid {lighthouse}," in ln]) == 1
    assert re.search(rf"resumed from \S+/step-({EVERY}|{2 * EVERY}|{3 * EVERY}) ", text), \
        text[-3000:]
    entries = read(run_dir / "ledger.jsonl")
    assert [e.step for e in entries] == list(range(1, STEPS + 1))
    assert check_exactly_once(entries) == []
    mine, reference = final_weights(run_dir), final_weights(fault_free)
    assert all(torch.equal(mine[k], reference[k]) for k in reference)
