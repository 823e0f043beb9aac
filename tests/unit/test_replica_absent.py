"""Groups started with the job that never join are named: a real torchft Manager (replica
group 0) and a real Lighthouse, in a job of three groups whose other two (a replica and
the spare) never come. After the first quorum's wait, the step's writer says which
groups are missing, by id."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from launcher.detection.torchft_tools import lighthouse_binary
from tests.harness.runs import ROOT, clean_env, limit, wait_for
from train.core.config import Config
from train.core.run.identity import WorkerIdentity

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None or lighthouse_binary() is None,
    reason="needs torchft and its torchft_lighthouse (make ft)")

WAIT_S = 2.0


def seat(group_id: int, lighthouse: str):
    """Replica group ``group_id`` of a job of three: its identity and its Manager (which
    heartbeats to the Lighthouse from now on)."""
    from train.distributed.replica_group import ReplicaGroup
    env = WorkerIdentity(replica_group=group_id, replica_groups=3, lighthouse=lighthouse,
                         replica_addr="127.0.0.1")
    return env, ReplicaGroup(Config(), env, torch.device("cpu"), dict, lambda state: None)


def first_quorum_of(env: WorkerIdentity, group):
    from train.loop.replica_quorum import first_quorum, say_absent
    quorum = first_quorum(group, 3, WAIT_S, start=0)
    say_absent(SimpleNamespace(env=env), quorum, 3, WAIT_S, start=0)
    return quorum


def test_groups_that_never_join_are_named_by_the_writer(lighthouse, caplog):
    caplog.set_level(logging.INFO, logger="train")
    env, group = seat(0, lighthouse)
    try:
        quorum = first_quorum_of(env, group)
    finally:
        group.close()
    assert quorum.members == (0,) and quorum.participants == 1
    named = [r.getMessage() for r in caplog.records if "did not join" in r.getMessage()]
    assert named == [f"replica groups 1, 2 did not join within {WAIT_S:.0f} s "
                     "(distributed.replica_timeout_s); training with 1 of 3 replica groups "
                     "(one that comes later heals and joins)"], caplog.text


SEAT = """import json, sys, time
from pathlib import Path
from tests.unit.test_replica_absent import first_quorum_of, seat
group_id, lighthouse, folder = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
env, group = seat(group_id, lighthouse)
(folder / f"ready-{group_id}").touch()
while not (folder / "go").exists():
    time.sleep(0.01)
quorum = first_quorum_of(env, group)
print(json.dumps({"members": quorum.members, "quorum_id": quorum.quorum_id}), flush=True)
group.close()
"""


def test_the_groups_there_end_the_wait_in_one_quorum(lighthouse, tmp_path):
    """Groups 0 and 1 (two processes) wait for the spare that never comes; each counts
    the Lighthouse's rounds, not its own clock, so both start training in the same quorum
    (one that ended its wait a round before the other would train alone while the other
    asks again)."""
    procs = [subprocess.Popen([sys.executable, "-c", SEAT, str(g), lighthouse, str(tmp_path)],
                              cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)),
                              stdout=subprocess.PIPE, text=True) for g in (0, 1)]
    try:
        wait_for(lambda: all((tmp_path / f"ready-{g}").exists() for g in (0, 1)), limit(120),
                 "both groups' Managers")  # both beating before either asks
        (tmp_path / "go").touch()
        quorums = [json.loads(p.communicate(timeout=limit(120))[0]) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert quorums[0] == quorums[1] and quorums[0]["members"] == [0, 1], quorums
