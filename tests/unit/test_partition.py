"""A partition between the nodes of an elastic job (launcher/liveness/partition.py): when
every node's ranks wait for each other in the same phase past the bound, each node names
it and hands the verdict to its waiting ranks, whose hang watchdog ends with it. The
decision is pure (given the nodes' published waits); the watchdog's side is a real
process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from launcher.liveness.partition import (
    NodeWait,
    PartitionWatch,
    bound_s,
    local_wait,
    verdict,
    wait_key,
)
from launcher.liveness.rdzv_state import Round
from tests.harness.runs import limit
from train.core.run import protocol
from train.core.run.identity import WorkerIdentity
from train.core.run.protocol import Report, Reporter, Waiting

A, B = "10.0.0.2:100#7", "10.0.0.3:200#9"
NOW = 1_000_000.0


def node_wait(phase="in step 23", waited=31.0, step_s=0.5, ranks=(0,), number=4):
    return NodeWait(number, phase, ranks, waited, step_s)


def test_the_bound_is_three_step_times_within_30_and_60_s():
    assert bound_s(0.1) == 30
    assert bound_s(15) == 45
    assert bound_s(100) == 60


def test_every_node_waiting_in_the_same_step_past_the_bound_is_a_partition_named_in_one_line():
    line = verdict({A: 0, B: 1}, {A: node_wait(ranks=(0, 1)), B: node_wait(waited=30.5,
                                                                         ranks=(2, 3))}, 4)
    assert line is not None and "\n" not in line
    assert line.startswith("lost contact between nodes: every node's ranks have waited in "
                           "step 23 for 30 s while the rendezvous store still answers "
                           f"({A} ranks 0-1, {B} ranks 2-3): a network partition"), line


@pytest.mark.parametrize("waits", [
    {A: node_wait()},                                          # B publishes nothing
    {A: node_wait(), B: None},
    {A: node_wait(), B: node_wait(waited=29.0)},               # B under the bound
    {A: node_wait(), B: node_wait(phase="in the checkpoint of step 22")},
    {A: node_wait(), B: node_wait(number=3)},                  # an earlier round's entry
    {A: node_wait(step_s=15), B: node_wait(step_s=15)},        # 45 s for steps of 15 s
])
def test_no_partition_unless_every_member_waits_in_one_phase_past_the_bound(waits):
    assert verdict({A: 0, B: 1}, waits, 4) is None


def test_a_round_of_one_node_is_never_a_partition():
    assert verdict({A: 0}, {A: node_wait(waited=600)}, 4) is None


def _report(rank, phase="in step 23", since=NOW - 35, step_s=0.5, restart=0, **extra):
    waiting = None if phase is None else Waiting(phase, since, step_s)
    return Report(rank=rank, local_rank=rank % 2, restart=restart, stage="training",
                  step=22, waiting=waiting, **extra)


def test_a_node_waits_when_every_local_rank_of_the_latest_attempt_waits_in_one_phase():
    mine = local_wait([_report(0), _report(1, since=NOW - 32)], 2, 4, NOW)
    assert mine == NodeWait(4, "in step 23", (0, 1), 32.0, 0.5)
    old = _report(5, phase="in step 3", restart=0)
    assert local_wait([old, _report(0, restart=1), _report(1, restart=1)], 2, 4, NOW) \
        is not None  # an earlier attempt's report is not this one's


@pytest.mark.parametrize("reports", [
    [_report(0)],                                              # one of two reported
    [_report(0), _report(1, phase=None)],                      # one computes
    [_report(0), _report(1, phase="in the checkpoint of step 22")],
    [_report(0), _report(1, step_s=None)],                     # before the first step time
    [_report(0), _report(1, exit_code=1)],                     # one ended
])
def test_a_node_does_not_wait_while_a_local_rank_does_something_else(reports):
    assert local_wait(reports, 2, 4, NOW) is None


@pytest.mark.parametrize("raw", [None, b"", b"x" * 20000, b"not json", b"[1, 2]",
                                 b'{"round": 4, "phase": "in step 1", "ranks": [0]}',
                                 b'{"round": 4, "phase": "p", "ranks": [0], "waited_s": NaN, '
                                 b'"step_s": 1}',
                                 b'{"round": 4, "phase": "p", "ranks": ["x"], "waited_s": 1, '
                                 b'"step_s": 1}'])
def test_an_entry_from_the_store_is_read_only_when_well_formed(raw):
    assert NodeWait.parse(raw) is None


def test_an_entry_round_trips_and_a_name_from_the_network_is_escaped():
    wait = node_wait(phase="in step 23\x1b[2J\nforged")
    back = NodeWait.parse(wait.to_json().encode())
    assert back is not None and "\n" not in back.phase and back.ranks == (0,)


class FakeStore:
    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def delete_key(self, key):
        return self.data.pop(key, None) is not None


def _node(tmp_path, name, ranks, since):
    folder = tmp_path / name
    folder.mkdir()
    for rank in ranks:
        protocol.write(folder, _report(rank, since=since))
    return folder


def test_each_node_publishes_its_wait_names_the_partition_and_hands_it_to_its_ranks(tmp_path):
    store, lines = FakeStore(), []
    r = Round(4, True, False, None, members={A: 0, B: 1})
    now = time.time()
    folders = [_node(tmp_path, "a", (0, 1), now - 40), _node(tmp_path, "b", (2, 3), now - 10)]
    watches = [PartitionWatch("job", member.rsplit(":", 1)[1], str(folder), 2, lines.append)
               for member, folder in zip((A, B), folders, strict=True)]
    assert watches[0].look(store, r) is None  # B's ranks have not waited long enough
    assert wait_key("job", "100#7") in store.data and wait_key("job", "200#9") not in store.data
    for rank in (2, 3):
        protocol.write(folders[1], _report(rank, since=now - 35))
    assert watches[1].look(store, r) is not None
    watches[0].looked_at = -1e9
    assert watches[0].look(store, r) == lines[0] == lines[1]  # A adopts B's words
    assert watches[0].look(store, r) is None and len(lines) == 2  # said once
    ident = WorkerIdentity(rank=0, local_rank=0, world_size=4, restart_count=0,
                           status_dir=str(folders[0]))
    assert Reporter(ident).verdict("in step 23") == lines[0]
    assert Reporter(ident).verdict("in step 24") is None  # another wait of the same attempt
    later = WorkerIdentity(rank=0, local_rank=0, world_size=4, restart_count=1,
                           status_dir=str(folders[0]))
    assert Reporter(later).verdict("in step 23") is None  # an earlier attempt's verdict
    protocol.write(folders[0], _report(0, phase=None))  # the wait ended: withdrawn
    watches[0].look(store, r)
    assert wait_key("job", "100#7") not in store.data


def test_the_watchdog_reports_a_wait_in_a_collective_and_ends_with_the_launchers_verdict(
        tmp_path):
    code = textwrap.dedent(f"""\
        import time
        from train.core.run.identity import WorkerIdentity
        from train.core.run.protocol import Reporter, WAITS_FOR_RANKS
        from train.guards import watchdog
        watchdog.where = lambda frame: (WAITS_FOR_RANKS, "ranks.py:1 in all_reduce")
        ident = WorkerIdentity(rank=1, local_rank=0, world_size=2, restart_count=0,
                               status_dir={str(tmp_path)!r})
        w = watchdog.Watchdog(600, Reporter(ident))
        w.pace(0.1)
        w.pet(22)
        time.sleep(60)
        """)
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + limit(60)
        report = None
        while report is None or report.waiting is None:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
            report = next(iter(protocol.read_all(tmp_path)), None)
        assert report.waiting.phase == "in step 23" and report.waiting.step_s == 0.1
        protocol.write_verdict(tmp_path, 0, "in step 23", "lost contact between nodes: test")
        assert proc.wait(limit(30)) == 1
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert "rank 1: hang watchdog: lost contact between nodes: test; every thread's stack " \
           "follows" in err, err[-2000:]
    ended = protocol.read_all(tmp_path)[0]
    assert ended.hung == protocol.WAITS_FOR_RANKS and ended.error.startswith("lost contact")
    assert [json.loads(line)["error"] for line in
            (tmp_path / protocol.FAILURES).read_text().splitlines()] == [ended.error]


def test_a_rank_killed_while_it_waited_is_no_wait_of_its_node(tmp_path):
    """Its report stays behind (a lost node's restart killed it): the node computes or
    restarts, and publishes nothing."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    folder = tmp_path / "a"
    folder.mkdir()
    protocol.write(folder, _report(0, since=time.time() - 40))
    protocol.write(folder, _report(1, since=time.time() - 40, pid=int(dead.stdout)))
    store = FakeStore()
    watch = PartitionWatch("job", "100#7", str(folder), 2, print)
    assert watch.look(store, Round(4, True, False, None, members={A: 0, B: 1})) is None
    assert not store.data


def test_once_a_rank_said_how_it_ended_no_wait_replaces_that_report(tmp_path):
    reporter = Reporter(WorkerIdentity(rank=0, status_dir=str(tmp_path)))
    reporter.waiting(22, Waiting("in step 23", NOW, 0.5))
    reporter.ended(1, "RuntimeError: timed out")
    reporter.waiting(22, None)  # the watchdog's thread, a moment late
    [report] = protocol.read_all(tmp_path)
    assert report.exit_code == 1 and report.error == "RuntimeError: timed out"
