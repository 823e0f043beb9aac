"""Groups started with the job that never join are named: a real torchft Manager (replica
group 0) and a real Lighthouse, in a job of three groups whose other two (a replica and
the spare) never come. After the first quorum's wait, the step's writer says which
groups are missing, by id."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
from types import SimpleNamespace

import pytest
import torch

from launcher.detection.system import free_port
from launcher.detection.torchft_tools import lighthouse_binary
from launcher.running.lighthouse import reachable
from tests.harness.runs import limit, wait_for
from train.core.config import Config
from train.core.run.identity import WorkerIdentity
from train.core.run.replica_contract import Timeouts, lighthouse_argv

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None or lighthouse_binary() is None,
    reason="needs torchft and its torchft_lighthouse (make ft)")

WAIT_S = 2.0


@pytest.fixture
def lighthouse():
    port = free_port()
    timeouts = Timeouts.of(Config().distributed.replica_timeout_s)
    proc = subprocess.Popen(lighthouse_argv(lighthouse_binary(), f"127.0.0.1:{port}", timeouts),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: reachable(f"127.0.0.1:{port}"), limit(30), "the Lighthouse's port")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def first_quorum_of(group_id: int, lighthouse: str):
    from train.distributed.replica_group import ReplicaGroup
    from train.loop.replica_loop import first_quorum, say_absent
    env = WorkerIdentity(replica_group=group_id, replica_groups=3, lighthouse=lighthouse,
                         replica_addr="127.0.0.1")
    group = ReplicaGroup(Config(), env, torch.device("cpu"), dict, lambda state: None)
    try:
        quorum = first_quorum(group, 3, WAIT_S)
        say_absent(SimpleNamespace(env=env), quorum, 3, WAIT_S)
        return quorum
    finally:
        group.close()


def test_groups_that_never_join_are_named_by_the_writer(lighthouse, caplog):
    caplog.set_level(logging.INFO, logger="train")
    quorum = first_quorum_of(0, lighthouse)
    assert quorum.members == (0,) and quorum.participants == 1
    named = [r.getMessage() for r in caplog.records if "did not join" in r.getMessage()]
    assert named == [f"replica groups 1, 2 did not join within {WAIT_S:.0f} s "
                     "(distributed.replica_timeout_s); training with 1 of 3 replica groups "
                     "(one that comes later heals and joins)"], caplog.text
