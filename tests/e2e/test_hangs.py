"""Hangs named right: two processes under the launcher, one of them stops making progress
(asleep in its own dataset, or frozen by SIGSTOP); the one line names that rank, not the
one that timed out waiting for it, and says where it was."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.harness.procs import environ, worker_of_rank
from tests.harness.runs import ENTRY, TINY_MLP, clean_env, limit, merge, write_config
from train.core.run.protocol import Report

SLEEPY = '''\
import os, time
import torch
from torch.utils.data import Dataset


class Sleepy(Dataset):
    """Rank 1 falls asleep for good after a few batches."""
    def __init__(self, n):
        self.x, self.y = torch.randn(n, 16), torch.randint(0, 4, (n,))
        self.reads = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == 1:
            with open("builds.txt", "a") as f:
                f.write(f"read {os.environ.get('RANK', 'launcher')}\\n")
        if os.environ.get("RANK") == "1" and self.reads > 40:
            time.sleep(3600)
        return self.x[i], self.y[i]


def make(n=512):
    return Sleepy(n), Sleepy(64)
'''


# A model whose rank 1 freezes itself (SIGSTOP) in its first checkpoint, when its state
# is collected: the other rank then waits in the checkpoint's agreement.
FREEZES_IN_CHECKPOINT = '''\
import os, signal
from torch import nn


def build(inputs, outputs):
    model = nn.Sequential(nn.Linear(inputs, 32), nn.ReLU(), nn.Linear(32, outputs))

    def freeze(module, state, prefix, local_metadata):
        if os.environ.get("RANK") == "1":
            with open("frozen.pid", "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)

    model._register_state_dict_hook(freeze)
    return model
'''


def _config(tmp_path: Path, max_restarts: int = 0, **data) -> Path:
    return write_config(tmp_path / "c.yaml", merge(TINY_MLP, {
        "output": {"dir": str(tmp_path / "runs")}, "data": data,
        "train": {"max_steps": 100000, "eval_every_steps": 0},
        "checkpoint": {"every_steps": 0},
        "distributed": {"nproc_per_node": 2, "timeout_s": 10, "max_restarts": max_restarts,
                        "grace_period_s": 10}}))


def _last_line(proc: subprocess.Popen, timeout: float) -> str:
    _, err = proc.communicate(timeout=limit(timeout))
    assert proc.returncode == 1, err[-3000:]
    return err.strip().splitlines()[-1]


def test_a_rank_asleep_in_its_dataset_is_named_with_its_frame(tmp_path):
    (tmp_path / "sleepy.py").write_text(SLEEPY)
    config = _config(tmp_path, kind="custom", factory="sleepy:make", args={"n": 512})
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, ENTRY, "train", str(config)], cwd=tmp_path,
                            env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    last = _last_line(proc, 240)
    assert last.startswith("error: training failed: rank 1 hung: no progress for "), last
    assert "(80% of distributed.timeout_s: 8 s): stuck in its own code at sleepy.py:" in last, last
    # rank 1 reports first (at 80 % of the timeout): rank 0 is stopped by torchrun before
    # its own collective times out, so the line need not say it waited
    assert "in __getitem__" in last, last
    print(f"a sleeping rank named {time.monotonic() - started:.0f} s after the start")


def test_a_hang_that_recurs_from_the_same_checkpoint_is_not_restarted_again(tmp_path):
    """torchrun may restart 3 times; the hang comes back in the same place from the same
    checkpoint (none), so the third attempt ends at once and so does any after it."""
    (tmp_path / "sleepy.py").write_text(SLEEPY)
    config = _config(tmp_path, max_restarts=3, kind="custom", factory="sleepy:make",
                     args={"n": 512})
    proc = subprocess.Popen([sys.executable, ENTRY, "train", str(config)], cwd=tmp_path,
                            env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    last = _last_line(proc, 400)
    assert "rank 1 hung: no progress for " in last and "sleepy.py:" in last, last
    assert "the same failure in two attempts in a row" in last, last
    assert "not restarted again" in last, last
    reads = (tmp_path / "builds.txt").read_text().split()
    assert reads.count("1") == 2, reads  # rank 1 read data in the first two attempts only


def test_a_frozen_rank_is_named_by_its_last_progress(tmp_path):
    config = _config(tmp_path)
    log = tmp_path / "stderr.log"
    with log.open("w") as err:  # a pipe nobody reads while waiting would stall the run
        proc = subprocess.Popen([sys.executable, ENTRY, "train", str(config)], cwd=tmp_path,
                                env=clean_env(), stdout=subprocess.PIPE, stderr=err,
                                text=True)
    for line in proc.stdout:
        if "step 20/" in line:  # "[default0]:step 20/...", torchrun's prefix
            break
    frozen = worker_of_rank(proc.pid, "1")
    reported = _progress(frozen, at_least=20)
    os.kill(frozen, signal.SIGSTOP)  # no watchdog of its own can run now
    try:
        proc.stdout.read()  # to its end
        assert proc.wait(timeout=limit(240)) == 1, log.read_text()[-3000:]
        last = log.read_text().strip().splitlines()[-1]
    finally:
        try:
            os.kill(frozen, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert last.startswith("error: training failed: rank 1 stopped making progress (its "
                           "last progress report: step "), last
    step = int(last.split("progress report: step ")[1].split(")")[0])
    assert step >= reported, last
    assert "rank 0 timed out waiting for it" in last, last
    assert "no error file defined for parent" not in log.read_text()  # torch's noise


def _progress(pid: int, at_least: int) -> int:
    """Wait until the worker's report says it reached ``at_least`` steps; that step."""
    env = environ(pid)
    report = Path(env["TRAIN_LAUNCHER_STATUS_DIR"]) / f"rank-{env['LOCAL_RANK']}.json"
    deadline = time.monotonic() + limit(120)
    while time.monotonic() < deadline:
        try:
            step = Report.from_dict(json.loads(report.read_text())).step or 0
        except (OSError, ValueError, TypeError):
            step = -1
        if step >= at_least:
            return step
        time.sleep(0.1)
    raise AssertionError(f"{report} never reached step {at_least}")


def test_a_rank_frozen_in_a_checkpoint_is_named_before_the_collective_timeout(tmp_path):
    """Checkpoints are watched like steps: the rank left waiting in the checkpoint's
    agreement reports at 80 % of distributed.timeout_s, saying where it waited, and the
    line names the frozen rank; the collective's own timeout (20 s) never decides."""
    (tmp_path / "freezing.py").write_text(FREEZES_IN_CHECKPOINT)
    config = write_config(tmp_path / "c.yaml", merge(TINY_MLP, {
        "output": {"dir": str(tmp_path / "runs")},
        "model": {"kind": "custom", "factory": "freezing:build",
                  "args": {"inputs": 16, "outputs": 4}},
        "train": {"max_steps": 100, "eval_every_steps": 0},
        "checkpoint": {"every_steps": 5},
        "distributed": {"nproc_per_node": 2, "timeout_s": 20, "max_restarts": 0,
                        "grace_period_s": 10}}))
    log = tmp_path / "stderr.log"
    try:
        with log.open("w") as err:
            proc = subprocess.run([sys.executable, ENTRY, "train", str(config)],
                                  cwd=tmp_path, env=clean_env(), stdout=subprocess.DEVNULL,
                                  stderr=err, text=True, timeout=limit(240))
    finally:
        frozen = tmp_path / "frozen.pid"
        if frozen.exists():
            try:
                os.kill(int(frozen.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    text = log.read_text()
    assert proc.returncode == 1, text[-3000:]
    assert frozen.exists(), text[-3000:]  # it did freeze in the checkpoint
    last = text.strip().splitlines()[-1]
    assert last.startswith("error: training failed: rank 1 stopped making progress"), last
    assert re.search(r"rank 0 timed out waiting for it: no progress for \d+ s in the "
                     r"checkpoint of step 5 \(80% of distributed.timeout_s: 16 s\): waiting "
                     r"for the other ranks", last), last
