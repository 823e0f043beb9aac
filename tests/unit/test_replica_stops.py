"""How replica groups stop. The Lighthouse a launcher starts ignores SIGTERM and the
requeue signal (on SLURM they reach every process of the step at once, and the groups
still need it to agree on their last step) and goes when its launcher kills it. A replica
group's torchrun stops its workers for a restart with SIGKILL two seconds after SIGTERM,
not torch's 30 (a survivor blocked in a quorum would keep its group in the quorum).
The whole job stopped on a real SLURM cluster: tests/e2e/test_slurm_replicas.py.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from launcher.detection import torchft_tools
from launcher.liveness.rounds import reachable
from launcher.running import group_restarts
from launcher.running import lighthouse as beacon
from tests.unit import test_replica_plan as one_machine

config = one_machine.config  # its fixture


@pytest.fixture
def real_lighthouse(monkeypatch):
    binary = torchft_tools.lighthouse_binary()
    if binary is None:
        pytest.skip("needs torchft's torchft_lighthouse (make ft)")
    real = torchft_tools.lighthouse_binary
    monkeypatch.setattr(torchft_tools, "lighthouse_binary", lambda *a, **k: real(*a, **k))
    return binary


def test_the_lighthouse_outlives_a_jobs_stop_signals_and_goes_when_killed(config,
                                                                          real_lighthouse):
    p = one_machine.prepare("train", config, "distributed.replicas=2")
    plan = dataclasses.replace(p.plan, requeue_signal=int(signal.SIGUSR1))  # SLURM's
    started = beacon.start(plan, (), lambda line: None)
    assert isinstance(started, beacon.Lighthouse), started
    try:
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM):
            os.kill(started.proc.pid, signum)
        time.sleep(0.5)  # a Lighthouse that died of them would be gone by now
        assert started.proc.poll() is None and reachable(f"127.0.0.1:{started.port}")
    finally:
        beacon.end(started.proc, 10.0)
    assert started.proc.returncode == -signal.SIGKILL


def test_a_replica_groups_restart_stops_its_workers_within_seconds():
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext
    before = LocalElasticAgent._stop_workers, PContext.close, SubprocessContext._close
    asked = []
    try:
        group_restarts.install()
        agent = object.__new__(LocalElasticAgent)
        agent._shutdown = lambda death_sig=signal.SIGTERM, timeout=30: asked.append(
            ("restart", death_sig, timeout))
        agent._stop_workers(None)
        # a worker failed: torch stops the others with close()'s defaults
        SubprocessContext._close = lambda self, death_sig, timeout=30: asked.append(
            ("failed", death_sig, timeout))
        context = object.__new__(SubprocessContext)
        context._tail_logs, context.filtered_stdout, context.filtered_stderr = [], None, None
        context.close()
        context.close(signal.SIGTERM, 115)  # the job's stop: its grace
    finally:
        LocalElasticAgent._stop_workers, PContext.close, SubprocessContext._close = before
    stop_s = group_restarts.RESTART_STOP_S
    assert asked == [("restart", signal.SIGTERM, stop_s), ("failed", signal.SIGTERM, stop_s),
                     ("failed", signal.SIGTERM, 115)]
