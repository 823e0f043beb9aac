"""The stop agreement between ranks (train/guards/stopping.py), in 2 real processes on
gloo (127.0.0.1): a request on one rank stops both after the same step: the first
logging step after it (the agreement rides on that step's gather), or the second
agreement of its own after it (one comes 0.5 s of steps after the last agreement, unless
a logging step is as near, and reads the reduction the previous one started). The
trainer's signal path end to end: tests/e2e/test_checkpoint_runs.py (SIGTERM to one
rank)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from launcher.detection.system import free_port
from tests.harness.runs import ROOT, limit, worker_env

# For each case, rank 1 is asked to stop at its step "request"; the loop logs every
# "log_every" steps as the trainer does (gathering the flag with its step time) and says
# at which step its rank stopped.
LOOP = """
import json, sys
import torch, torch.distributed as dist
from train.distributed.ranks import gather_over_ranks
from train.guards.stopping import StopFlag
dist.init_process_group("gloo")
rank = dist.get_rank()
said = []
for request, log_every, step_time in json.loads(sys.argv[1]):
    stop = StopFlag(log_every=log_every)
    for step in range(1, 1000):
        if rank == 1 and step == request:
            stop.requested = True  # what its SIGTERM handler sets
        if step == 1 or step % log_every == 0:
            rows = gather_over_ranks([step_time, float(stop.requested)], torch.device("cpu"),
                                     True)
            stop.pace(rows[0][0], step, any(row[1] for row in rows))
        if stop.agreed(step, torch.device("cpu"), True):
            break
    said.append({"stopped": step, "every": stop.every})
print(json.dumps(said))
dist.destroy_process_group()
"""

CASES = [
    (8, 1000, 0.3),   # no logging step near: its own agreements every 2 steps (0.6 s)
    (7, 1000, 0.05),  # short steps: every 10
    (7, 8, 0.05),     # logging every 8 steps: the agreement rides on it, none of its own
    (21, 12, 0.05),   # none of its own at 22: logging step 24 is nearer than 10 steps
    (14, 10, 0.17),   # every 3: 16 starts a reduction, none at 19 (logging step 20 is near)
    (12, 10, 0.17),   # 13 starts a reduction, 16 reads it
    (5, 1000, 2.0),   # steps longer than 0.5 s: every step
]


def expected_stop(request: int, log_every: int, step_time: float) -> int:
    """The rule: a logging step agrees on the flags of that step; any other step agrees
    when the last agreement is ceil(0.5 s / step time) steps old and no logging step is
    as near, on the flags all-reduced at the previous such step (that reduction was left
    to finish meanwhile)."""
    every, last, in_flight = math.ceil(0.5 / step_time), 0, None
    for step in range(1, 1000):
        if step == 1 or step % log_every == 0:
            last = step
            if step >= request:
                return step
        elif step - last >= every and log_every - step % log_every >= every:
            last = step
            if in_flight is not None and in_flight >= request:
                return step
            in_flight = step
    raise AssertionError("never stops")


def run_cases() -> list[list[dict]]:
    """Every case in the same 2 processes: each rank's results, in rank order."""
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-c", LOOP, json.dumps(CASES)], cwd=ROOT,
        env=worker_env({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for rank in (0, 1)]
    out = [p.communicate(timeout=limit(120)) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in out]
    return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in out]


def test_a_request_on_one_rank_stops_both_at_the_first_step_that_logs_or_agrees():
    rank0, rank1 = run_cases()
    for (request, log_every, step_time), zero, one in zip(CASES, rank0, rank1, strict=True):
        every = math.ceil(0.5 / step_time)
        assert every * step_time >= 0.5  # never more often than every 0.5 s of steps
        stop = expected_stop(request, log_every, step_time)
        assert zero == one == {"stopped": stop, "every": every}, (request, log_every,
                                                                 step_time)
