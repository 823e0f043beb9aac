"""The ranks of a replica group watching each other (train/distributed/group_pulse.py),
for real: two processes beating in one TCPStore (this test's). One of them frozen
(SIGSTOP) while the other is in a step: the other ends at once, exit 1, one line naming
the silent rank and its host. Outside a step the same silence is not judged (a rank that
finished the run, or stopped, ends before its peers), nor is any while the process
itself was stopped: a whole group frozen and continued trains on. A group of two nodes
on a real SLURM cluster: tests/e2e/test_slurm_replicas.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from tests.harness.runs import clean_env, limit, wait_for
from train.distributed.group_pulse import PREFIX

ROOT = Path(__file__).resolve().parents[2]
SILENT_S = 1.0
RANK = """
import sys, time
from torch.distributed import TCPStore
from train.distributed.group_pulse import PREFIX, GroupPulse
port, rank, armed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "armed"
pulse = GroupPulse("127.0.0.1", port, rank, 2, 1, silent_s={silent}, name=f"host{{rank}}")
if armed:  # once the other beats: a step of the group
    store = TCPStore("127.0.0.1", port, is_master=False)
    while store.add(PREFIX + str(1 - rank), 0) < 2:
        time.sleep(0.05)
    pulse.arm()
    print("armed", flush=True)
time.sleep(120)
"""


@pytest.fixture
def store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def rank(store: TCPStore, r: int, armed: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RANK.format(silent=SILENT_S),
                             str(store.port), str(r), "armed" if armed else "calm"],
                            cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def beating(store: TCPStore, *ranks: int) -> bool:
    return all(store.add(f"{PREFIX}{r}", 0) > 0 for r in ranks)


def test_a_frozen_rank_ends_its_peer_in_a_step_naming_it(store):
    watcher, frozen = rank(store, 0, armed=True), rank(store, 1, armed=False)
    try:
        wait_for(lambda: beating(store, 0, 1), limit(60), "both ranks beating")
        assert watcher.stdout.readline().strip() == "armed"
        os.kill(frozen.pid, signal.SIGSTOP)
        assert watcher.wait(timeout=limit(30)) == 1
    finally:
        for p in (watcher, frozen):
            p.kill()
            p.wait()
    err = watcher.stderr.read()
    assert "replica group 1: rank 1 (host1) has been silent for" in err, err
    assert "this rank leaves so that its group restarts" in err and "Traceback" not in err


def test_outside_a_step_a_silent_rank_is_not_judged(store):
    calm, frozen = rank(store, 0, armed=False), rank(store, 1, armed=False)
    try:
        wait_for(lambda: beating(store, 0, 1), limit(60), "both ranks beating")
        os.kill(frozen.pid, signal.SIGSTOP)
        seen = store.add(f"{PREFIX}0", 0)
        # the calm rank beats on, well past the silence that would end it in a step
        wait_for(lambda: store.add(f"{PREFIX}0", 0) > seen + 3 * SILENT_S / 0.25,
                 limit(60), "the calm rank's beats")
        assert calm.poll() is None, calm.stderr.read()
    finally:
        for p in (calm, frozen):
            p.kill()
            p.wait()


def test_a_whole_group_frozen_and_continued_trains_on(store):
    """A node that hangs with all of its group's ranks, then continues: every counter is
    old, each rank's own too, and none takes the others for lost."""
    ranks = [rank(store, 0, armed=True), rank(store, 1, armed=True)]
    try:
        wait_for(lambda: beating(store, 0, 1), limit(60), "both ranks beating")
        assert [p.stdout.readline().strip() for p in ranks] == ["armed", "armed"]
        for p in ranks:
            os.kill(p.pid, signal.SIGSTOP)
        seen = [store.add(f"{PREFIX}{r}", 0) for r in (0, 1)]
        time.sleep(3 * SILENT_S)  # frozen three times as long as a silence that is a loss
        for p in ranks:
            os.kill(p.pid, signal.SIGCONT)
        wait_for(lambda: all(store.add(f"{PREFIX}{r}", 0) > seen[r] + 3 * SILENT_S / 0.25
                             for r in (0, 1)), limit(60), "both ranks beating again")
        assert [p.poll() for p in ranks] == [None, None], [p.stderr.read() for p in ranks]
    finally:
        for p in ranks:
            p.kill()
            p.wait()
