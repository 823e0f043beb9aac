"""How a job of replica groups ends, from each group's own outcome
(launcher/running/replica_groups.py): done when one group finished, 143 after a stop,
else the first failure with its group named; a group that ended otherwise is one line;
how the groups stop when the Lighthouse is lost. The groups running for real:
tests/e2e/test_replica_launch.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.endings import verdicts
from launcher.endings.outcome import Outcome
from launcher.running.lighthouse import Lighthouse
from launcher.running.replica_groups import Group, _combine, _lost
from tests.harness.procs import alive
from tests.harness.runs import wait_for

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


# a group's torchrun that stops with a checkpoint on SIGTERM (it writes the file) and
# holds a child of its own until then
TORCHRUN = "import signal, subprocess, sys, time, pathlib; p = subprocess.Popen(['sleep', " \
           "'60']); signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path(sys.argv[1])" \
           ".write_text('stopped'), p.kill(), sys.exit(143))); print(p.pid, flush=True); " \
           "time.sleep(60)"


@pytest.mark.parametrize("own", [False, True])
def test_a_lighthouse_lost_from_one_node_kills_its_group_at_once(tmp_path, own):
    """Another node's Lighthouse lost, as this node sees it (on Kubernetes or SLURM it
    may be this node that lost the network): its group is killed at once, never told to
    stop, because a worker told to stop carries its stop to every group in the next
    step's all-reduce once the link is back. This launcher's own Lighthouse (one
    machine: every group lost it) still stops every group with a checkpoint."""
    mark = tmp_path / "checkpointed"
    proc = subprocess.Popen([sys.executable, "-c", TORCHRUN, str(mark)],
                            stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    exited = subprocess.Popen(["true"])
    exited.wait()
    beacon = Lighthouse(exited if own else None, 29510, "198.18.0.1", by="its Deployment's")
    plan = SimpleNamespace(replica_groups=SimpleNamespace(at="198.18.0.1:29510",
                                                          owner="its Deployment's"),
                           env={})
    lines = []
    try:
        line = _lost(plan, [Group(1, tmp_path, proc)], beacon, "stopped accepting "
                     "connections", lines.append)
    finally:
        proc.kill()
        proc.wait()
    assert line.endswith("stopped accepting connections while 1 replica group(s) ran")
    if own:
        assert mark.exists() and proc.returncode == 143, lines
    else:
        assert not mark.exists() and proc.returncode == -signal.SIGKILL, lines
        assert "killing this node's replica group to start again" in lines[0]
    # the group's own child too (a SIGKILL takes effect when the kernel next runs it)
    wait_for(lambda: not alive(child), 10, "the group's child gone")


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
