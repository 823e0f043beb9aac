"""The check a replica group makes when it finds itself alone in the quorum: did the
other groups finish the run (train/loop/replica_quorum.py::finished_without_us)? Each
rank of the group reads the run's result on its own; in 2 real processes on gloo
(127.0.0.1), one rank reads a finished result and the other reads none yet (the file
landed between their reads): both must take the same answer, or one rank would stop
while the other trains on and waits in a collective for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.harness.runs import ROOT, limit, worker_env

CHECK = """
import json, sys
from types import SimpleNamespace
import torch, torch.distributed as dist
from train.distributed.replica_group import Quorum
from train.loop.replica_quorum import finished_without_us
rank = int(sys.argv[5])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[4]}", rank=rank, world_size=2)
run_dir, participants = sys.argv[1 + rank], int(sys.argv[3])
c = SimpleNamespace(run_dir=run_dir, device=torch.device("cpu"),
                    cfg=SimpleNamespace(train=SimpleNamespace(max_steps=100)))
alone = Quorum(participant=0, participants=participants, step=80, healed=False)
print(json.dumps(finished_without_us(c, alone, expected=2)))
dist.destroy_process_group()
"""


def answers(finished: Path, empty: Path, participants: int) -> list[bool]:
    """Each rank's answer; rank 0 reads ``finished``, rank 1 ``empty``."""
    store = finished.parent / f"store-{participants}"  # a file: no port to collide on
    procs = [subprocess.Popen(
        [sys.executable, "-c", CHECK, str(finished), str(empty), str(participants),
         str(store), str(rank)], cwd=ROOT, env=worker_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    out = [p.communicate(timeout=limit(120)) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in out]
    return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in out]


def test_the_ranks_of_a_group_alone_agree_when_only_one_read_the_finished_result(tmp_path):
    finished, empty = tmp_path / "finished", tmp_path / "empty"
    finished.mkdir()
    empty.mkdir()
    (finished / "result.json").write_text(json.dumps({"step": 100}))
    assert answers(finished, empty, participants=1) == [True, True]
    # with another group in the quorum the run goes on, whatever the file says
    assert answers(finished, empty, participants=2) == [False, False]
