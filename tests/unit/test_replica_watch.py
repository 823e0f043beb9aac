"""A step's all-reduce given up as soon as the Lighthouse shows it cannot end
(train/distributed/replica_watch.py): the status page read as torchft's Lighthouse
writes it, and three real Managers (three processes) with a real Lighthouse and an
all-reduce timeout of 600 s. Group 1 frozen (SIGSTOP) after its quorum, before its
all-reduce, while the other two wait in theirs: they give the step up and train on
without it, long before that timeout. Thawed, group 1 reaches the all-reduce the others
left pending, which gloo then completes: its step is not applied all the same (the
Lighthouse has a newer quorum), and it trains with them again."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from launcher.detection.torchft_tools import lighthouse_binary
from tests.harness.runs import ROOT, clean_env, limit, wait_for
from train.core.config import Config
from train.core.run.identity import WorkerIdentity
from train.distributed.replica_watch import Status, parse, why_lost

# What torchft 0.2.0's Lighthouse serves at /status (recorded), trimmed to what is read
PAGE = """
Current quorum_id: 3 <br>
Next quorum status: New quorum not ready, only have 0 participants, need min_replicas 1 \
[0/0 participants healthy][2 heartbeating][shrink_only=false]
<h2>Heartbeats</h2>
<ul>
  <li class="heartbeat
  ">
    group_1:5c0e-41d2: seen 2.503767191s ago
  </li>
  <li class="heartbeat
  ">
    group_0:9a1b-77f0: seen 2.997338ms ago
  </li>
</ul>"""
MEMBERS = ["group_0:9a1b-77f0", "group_1:5c0e-41d2"]


def test_the_status_page_gives_the_quorum_and_each_groups_silence():
    assert parse(PAGE) == Status(3, {"group_1:5c0e-41d2": 2.503767191,
                                     "group_0:9a1b-77f0": 0.002997338})
    assert parse("<html>a page of another version</html>") is None


def test_a_silent_member_or_a_newer_quorum_gives_the_step_up():
    status = parse(PAGE)
    assert why_lost(status, MEMBERS, "group_0", 3, stale_s=2.25) == (
        "replica group 1 in this step's all-reduce is frozen or cut off (no heartbeat for "
        "2.5 s at the Lighthouse)")
    assert why_lost(status, MEMBERS, "group_0", 3, stale_s=3.0) is None  # not yet
    assert why_lost(status, MEMBERS, "group_1", 3, stale_s=2.25) is None  # its own silence
    assert "formed quorum 3 while this group was in a step of quorum 2:" in \
        why_lost(status, MEMBERS, "group_1", 2, stale_s=2.25)
    assert "(no heartbeat at the Lighthouse)" in \
        why_lost(status, [*MEMBERS, "group_2:0000"], "group_0", 3, stale_s=3.0)


LOOP = """import json, sys, time
from pathlib import Path
import torch
from tests.unit.test_replica_watch import seat
from train.loop.replica_quorum import first_quorum
group_id, lighthouse, folder = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
group = seat(group_id, lighthouse)
(folder / f"ready-{group_id}").touch()
while not (folder / "go").exists():
    time.sleep(0.01)
quorum = first_quorum(group, 3, 5.0, start=0)
with open(folder / f"steps-{group_id}.jsonl", "a") as out:
    while not (folder / "stop").exists():
        if group_id == 1 and (folder / "hold").exists() and not (folder / "held").exists():
            (folder / "held").touch()  # in the quorum, the others in the all-reduce
            while not (folder / "release").exists():
                time.sleep(0.01)
        group.sum(torch.ones(4))
        ok = group.commit()
        out.write(json.dumps({"members": quorum.members, "committed": ok,
                             "failure": group.failure()}) + "\\n")
        out.flush()
        time.sleep(0.02)
        quorum = group.quorum()
group.close()
"""
TIMEOUT_S = 600  # distributed.replica_timeout_s: the all-reduce's own limit


def seat(group_id: int, lighthouse: str):
    from train.distributed.replica_group import ReplicaGroup
    cfg = Config()
    cfg = replace(cfg, distributed=replace(cfg.distributed, replica_timeout_s=TIMEOUT_S))
    env = WorkerIdentity(replica_group=group_id, replica_groups=3, lighthouse=lighthouse,
                         replica_addr="127.0.0.1")
    return ReplicaGroup(cfg, env, torch.device("cpu"), dict, lambda state: None)


def steps(folder: Path, group: int) -> list[dict]:
    path = folder / f"steps-{group}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def committed_with(folder: Path, group: int, after: int, members: list[int]) -> bool:
    return any(s["committed"] and s["members"] == members
               for s in steps(folder, group)[after:])


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None or lighthouse_binary() is None,
                    reason="needs torchft and its torchft_lighthouse (make ft)")
def test_a_frozen_group_is_left_out_at_once_and_rejoins_when_thawed(lighthouse, tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", LOOP, str(g), lighthouse, str(tmp_path)],
                              cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)),
                              stderr=subprocess.PIPE, text=True) for g in range(3)]
    try:
        wait_for(lambda: all((tmp_path / f"ready-{g}").exists() for g in range(3)),
                 limit(120), "three Managers")
        (tmp_path / "go").touch()
        wait_for(lambda: all(committed_with(tmp_path, g, 0, [0, 1, 2]) for g in range(3)),
                 limit(120), "a step of all three groups")
        (tmp_path / "hold").touch()
        wait_for(lambda: (tmp_path / "held").exists(), limit(120), "group 1 held")
        at = {g: len(steps(tmp_path, g)) for g in range(3)}
        os.kill(procs[1].pid, signal.SIGSTOP)
        try:  # the survivors go on without it, well before their all-reduce's 600 s
            wait_for(lambda: all(committed_with(tmp_path, g, at[g], [0, 2]) for g in (0, 2)),
                     limit(120), "a step of groups 0 and 2 without the frozen group 1")
        finally:
            os.kill(procs[1].pid, signal.SIGCONT)
            (tmp_path / "release").touch()  # into the all-reduce the others gave up
        wait_for(lambda: committed_with(tmp_path, 1, at[1], [0, 1, 2]), limit(120),
                 "group 1 back in a committed step")
        (tmp_path / "stop").touch()
        for p in procs:
            p.wait(timeout=limit(120))
    finally:
        for p in procs:
            p.kill()
    given_up = [s["failure"] for g in (0, 2) for s in steps(tmp_path, g)[at[g]:]
                if not s["committed"]]
    assert given_up and all("replica group 1 in this step's all-reduce is frozen or cut "
                            "off (no heartbeat for" in f for f in given_up), given_up
    thawed = [s["failure"] for s in steps(tmp_path, 1)[at[1]:] if not s["committed"]]
    assert thawed and "the other groups went on without it" in thawed[0], thawed
