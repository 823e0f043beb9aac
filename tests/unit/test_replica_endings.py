"""How a job of replica groups ends, from each group's own outcome
(launcher/running/replica_groups.py): done when one group finished, 143 after a stop,
else the first failure with its group named; a group that ended otherwise is one line.
The groups running for real: tests/e2e/test_replica_launch.py."""

from __future__ import annotations

import signal
from pathlib import Path

from launcher.endings import verdicts
from launcher.endings.outcome import Outcome
from launcher.running.replica_groups import Group, _combine

FAILED = Outcome(1, "error: training failed: rank 0: RuntimeError: boom; details in its log x")
STOPPED = Outcome(143, "stopped by SIGTERM; rerun the same command to resume from the last "
                       "checkpoint")


def groups(*outcomes: Outcome) -> list[Group]:
    return [Group(i, Path("."), None, o, ended_at=10.0 - i) for i, o in enumerate(outcomes)]


def test_one_group_finished_is_done():
    assert _combine(None, groups(FAILED, Outcome(0), Outcome(0)), []) == Outcome(0)


def test_a_stop_is_143():
    assert _combine(None, groups(STOPPED, STOPPED), [signal.SIGTERM]) == STOPPED


def test_no_group_finished_is_the_first_failure_naming_its_group():
    # group 1 ended first (ended_at 9.0 < 10.0)
    ended = _combine(None, groups(Outcome(4, "error: diverged"), FAILED), [])
    assert ended.code == 1
    assert ended.message.startswith("error: replica group 1: training failed: rank 0: ")


def test_a_group_that_ended_otherwise_is_one_line():
    assert verdicts.group_ended(1, FAILED, 3) == (
        "replica group 1 gave up after 3 restart(s): training failed: rank 0: RuntimeError: "
        "boom; details in its log x")
    assert verdicts.group_ended(2, Outcome(4, "error: diverged at step 3"), 3) == \
        "replica group 2 ended with exit code 4: diverged at step 3"


def test_a_lighthouse_lost_once_too_often_says_who_resumes():
    """On one machine the user reruns the command; a pod of the Indexed Job is recreated
    by its Job (exit 1 counts against backoffLimitPerIndex), which nobody needs to do."""
    line = "the Lighthouse (its Deployment's, http://train-lighthouse:29510) stopped"
    here, pod = verdicts.lighthouse_lost(line, 3), verdicts.lighthouse_lost(line, 3, pod=True)
    assert here.code == pod.code == 1
    assert here.message == (f"error: training failed: {line}, after 3 relaunch(es) "
                            "(distributed.max_restarts); rerun the same command to resume "
                            "from the last checkpoint")
    assert pod.message.endswith("; the Job recreates this pod, which resumes from the last "
                                "checkpoint")
