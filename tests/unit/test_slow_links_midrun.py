"""The mid-run slow-link rule on the figures the logging gather carries (each rank's
step, data and compute time): the communication wait's baseline, a check asked for when
the wait grows well above it, and none for one slow interval, for all ranks' compute
slowing together, or for one straggling rank; then rank 0's verdict on the link timing
(three nodes: the node whose best link is slow; two: the link against its own earlier
speed). For real, with a throttled interface: tests/e2e/test_slow_link_midrun.py."""

from __future__ import annotations

import torch

from train.core.nodes.verdict import RankResult
from train.core.run.identity import WorkerIdentity
from train.observe import slowlinks
from train.observe.slowlinks import CommWait, LinkFinding, SlowLinks

EVERY = 10  # steps per logging interval
STEP_S = 0.5


def rows(step=STEP_S, data=0.05, compute=0.35, ranks=3, slow_rank=None, slow_compute=0.0):
    """Each rank's (step, data, compute) seconds a step: the wait is what is left."""
    out = [(step, data, compute)] * ranks
    if slow_rank is not None:
        out[slow_rank] = (step, data, slow_compute)
    return out


def feed(watch: CommWait, intervals) -> list[bool]:
    return [watch.observe(EVERY, r, r[0][0]) for r in intervals]


def test_the_first_full_window_after_the_start_is_the_baseline():
    watch = CommWait(ratio=1.3, steps=30)
    assert feed(watch, [rows(step=5.0)] + [rows()] * 3) == [False] * 4
    assert watch.baseline is not None
    wait, rest = watch.baseline
    assert abs(wait - 0.1) < 1e-9 and abs(rest - 0.4) < 1e-9  # the start-up left out


def test_a_wait_that_grows_and_stays_asks_for_a_check():
    watch = CommWait(ratio=1.3, steps=30)
    feed(watch, [rows()] * 4)
    slow = rows(step=0.9)  # the same data and compute, 0.5 s more wait a step
    assert feed(watch, [slow] * 3) == [False, True, True]  # once most of the window is
    assert abs(watch.grown_by - 5.0) < 1e-9  # the wait five times, the rest the same


def test_a_job_mostly_waiting_already_is_still_told():
    """The wait is 60 % of a step to begin with: a share could not grow 1.3 times."""
    watch = CommWait(ratio=1.3, steps=30)
    feed(watch, [rows(step=1.0, data=0.0, compute=0.4)] * 4)
    assert feed(watch, [rows(step=1.6, data=0.0, compute=0.4)] * 3)[-1]


def test_a_machine_slow_in_everything_is_silent():
    """Communication and compute slow alike (a busy CPU runs gloo too)."""
    watch = CommWait(ratio=1.3, steps=30)
    found = feed(watch, [rows()] * 4 + [rows(step=1.0, data=0.1, compute=0.7)] * 6)
    assert not any(found)


def test_one_slow_interval_moves_nothing():
    watch = CommWait(ratio=1.3, steps=30)
    found = feed(watch, [rows()] * 4 + [rows(step=3.0)] + [rows()] * 4)
    assert not any(found)


def test_compute_slowing_on_every_rank_is_silent():
    """A busy machine: every rank's compute doubles, the wait stays: its share shrinks."""
    watch = CommWait(ratio=1.3, steps=30)
    found = feed(watch, [rows()] * 4 + [rows(step=0.85, compute=0.7)] * 6)
    assert not any(found)


def test_a_straggling_rank_is_not_a_slow_link():
    """One rank's compute is slow; the others wait for it, the slowest waits no more."""
    watch = CommWait(ratio=1.3, steps=30)
    straggling = rows(step=0.9, slow_rank=1, slow_compute=0.75)
    assert not any(feed(watch, [rows()] * 4 + [straggling] * 6))


def test_off_with_a_ratio_of_zero():
    watch = CommWait(ratio=0, steps=30)
    assert not any(feed(watch, [rows()] * 4 + [rows(step=2.0)] * 6))


def nodes(count: int) -> list[RankResult]:
    return [RankResult(rank=n, node=n, host=f"host-{n}") for n in range(count)]


def links(count: int, preflight=None) -> SlowLinks:
    env = WorkerIdentity(rank=0, world_size=count)
    return SlowLinks(1.3, 30, 0.5, env, nodes(count), torch.device("cpu"), preflight)


def test_a_check_is_asked_for_when_the_wait_grows_and_not_again_within_the_interval(
        monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(slowlinks.time, "monotonic", lambda: clock[0])
    watch = links(3)
    for r in [rows()] * 4:
        watch.observe(0, EVERY, r, r[0][0])
    assert watch.flag() == 0.0  # three nodes: no baseline timing needed
    watch.observe(50, EVERY, rows(step=0.9), 0.9)
    watch.observe(60, EVERY, rows(step=0.9), 0.9)
    assert watch.flag() == 1.0
    watch.wanted, watch.last_check = False, clock[0]  # what a check does
    clock[0] += slowlinks.CHECK_EVERY_S / 2
    watch.observe(70, EVERY, rows(step=0.9), 0.9)
    assert watch.flag() == 0.0
    clock[0] += slowlinks.CHECK_EVERY_S
    watch.observe(80, EVERY, rows(step=0.9), 0.9)
    assert watch.flag() == 1.0


def test_two_nodes_without_a_preflight_time_their_link_once_the_baseline_is_set():
    watch = links(2)
    for r in [rows(ranks=2)] * 4:
        watch.observe(0, EVERY, r, r[0][0])
    assert watch.flag() == 1.0
    assert links(2, preflight={(0, 1): 5.0}).flag() == 0.0


def test_three_nodes_name_the_node_whose_best_link_is_slow_and_only_it():
    watch = links(3)
    found = watch._judge(70, {(0, 1): 5.0, (0, 2): 80.0, (1, 2): 90.0}, 1.5)
    assert [(f.node, f.host, f.against) for f in found] == [(2, "host-2", "other nodes")]
    line = found[0].line()
    assert line.startswith("slow link: node 2 (host-2) links 0.06x the other nodes' ("), line
    assert "at step 70" in line and "node 0" not in line and "node 1" not in line
    assert found[0].record()["event"] == "slow_link"
    assert watch._judge(70, {(0, 1): 5.0, (0, 2): 5.5, (1, 2): 6.0}, 1.5) == []
    [far] = watch._judge(80, {(0, 1): 5.0, (0, 2): 900.0, (1, 2): 950.0}, 1.5)
    assert " links 0.006x the other nodes' " in far.line(), far.line()  # not 0.00x


def test_two_nodes_say_how_their_link_compares_with_the_preflight():
    watch = links(2, preflight={(0, 1): 5.0})
    [found] = watch._judge(70, {(0, 1): 50.0}, 1.0)
    assert found.line().startswith(
        "slow link: the link between node 0 and node 1 (host-0, host-1) runs at 0.10x its "
        "preflight speed ("), found.line()
    assert watch._judge(70, {(0, 1): 6.0}, 1.0) == []


def test_two_nodes_without_a_preflight_compare_with_their_first_timing(monkeypatch):
    timings = iter([[(0, ((1, 5.0),)), (1, ((0, 5.5),))]])
    monkeypatch.setattr(slowlinks.links, "measure", lambda *a, **k: ())
    monkeypatch.setattr(slowlinks.ranks, "gather", lambda env: lambda mine: next(timings))
    watch = links(2)
    assert watch.check(40) == [] and watch.baseline == {(0, 1): 5.0}  # the first timing
    [found] = watch._judge(90, {(0, 1): 40.0}, 1.0)
    assert "runs at 0.12x its earlier speed" in found.line()


def test_a_named_node_keeps_pace_again_once_the_wait_is_back():
    watch = links(3)
    for r in [rows()] * 4 + [rows(step=0.9)] * 3:
        watch.observe(0, EVERY, r, r[0][0])
    watch.named = watch._judge(70, {(0, 1): 5.0, (0, 2): 80.0, (1, 2): 90.0}, 1.5)
    over: list[LinkFinding] = []
    for step, r in enumerate([rows()] * 4):
        over += watch.observe(80 + 10 * step, EVERY, r, r[0][0])
    assert [(f.node, f.record()["event"]) for f in over] == [(2, "slow_link_over")]
    assert over[0].line().startswith("slow link: node 2 (host-2) keeps pace again at step ")
