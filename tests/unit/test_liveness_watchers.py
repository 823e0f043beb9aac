"""The liveness seam (launcher/liveness/watchers.py): the plan chooses the watchers, the
supervisor only binds, starts, asks and stops them. The watchers themselves:
tests/unit/test_heartbeat.py, test_pulse.py and test_multinode.py."""

from __future__ import annotations

import dataclasses
import sys

from launcher.endings.verdicts import node_lost
from launcher.liveness import watchers
from launcher.liveness.watchers import Child, Liveness, Loss
from launcher.planning.plan import Plan
from launcher.running import supervise
from launcher.running.agent_contract import STORE_LOST
from launcher.running.signals import Forwarder

SLEEP = (sys.executable, "-c", "import time; time.sleep(60)")
EXIT_1 = (sys.executable, "-c", "raise SystemExit(1)")


def plan(**changes) -> Plan:
    base = Plan("torchrun", SLEEP, {}, "cpu", "gloo", 1, (1, 1), (1,), 0, "single")
    return dataclasses.replace(base, **changes)


def test_the_plan_chooses_the_watchers():
    assert plan().liveness == ()
    assert plan(store="store:29400", job="j1", nnodes=(1, 2)).liveness == ("rounds",)
    assert plan(heartbeat=("127.0.0.1", 29501, 1), static_nodes=True).liveness == \
        ("heartbeat",)
    kinds = [type(w) for w in watchers.for_plan(plan(store="s:1", job="j"), print).watchers]
    assert kinds == [watchers.Rounds]
    assert watchers.for_plan(plan(), print).watchers == []


class Fake:
    """A watcher that says what it was asked, and finds ``loss`` once the child started."""

    def __init__(self, loss: Loss | None = None, after: Loss | None = None) -> None:
        self.loss, self.after, self.calls = loss, after, []
        self.child: Child | None = None

    def bind(self):
        self.calls.append("bind")

    def start(self, child: Child) -> None:
        self.calls.append("start")
        self.child = child

    def lost(self, rc, signalled):
        if rc is None:
            return self.loss
        self.calls.append(f"lost after {rc}")
        return self.after

    def stop(self) -> None:
        self.calls.append("stop")


def run_with(monkeypatch, fake: Fake, p: Plan) -> tuple[int, object, list[str]]:
    monkeypatch.setattr(watchers, "for_plan", lambda plan, log: Liveness([fake]))
    logged: list[str] = []
    forwarder = Forwarder(None)
    rc, ended = supervise._start_and_wait(p, {}, (), forwarder, logged.append, None)
    return rc, ended, logged


def test_a_lost_store_ends_the_child_as_store_lost(monkeypatch):
    fake = Fake(loss=Loss("store", "the rendezvous store s:1 has not answered for 9 s"))
    rc, ended, logged = run_with(monkeypatch, fake, plan())
    assert (rc, ended) == (STORE_LOST, None)
    assert logged == ["the rendezvous store s:1 has not answered for 9 s"]
    assert fake.calls == ["bind", "start", f"lost after {STORE_LOST}", "stop"]
    assert fake.child.pid > 0
    assert not fake.child.workers_alive()


def test_a_lost_node_is_the_ending_once_the_child_failed(monkeypatch):
    fake = Fake(after=Loss("node", "lost node 1 (host1): no heartbeat for 8 s"))
    rc, ended, _ = run_with(monkeypatch, fake, plan(argv=EXIT_1, convention="pet"))
    assert rc == 1 and ended == node_lost("lost node 1 (host1): no heartbeat for 8 s", "pet")
    assert fake.calls == ["bind", "start", "lost after 1", "stop"]


def test_a_refused_bind_starts_nothing(monkeypatch):
    fake = Fake()
    fake.bind = lambda: "error: the heartbeat port 1 (MASTER_PORT + 1) cannot be listened on"
    rc, ended, _ = run_with(monkeypatch, fake, plan())
    assert rc == 0 and ended.code == 3 and fake.calls == ["stop"]
