"""The straggler rule on per-rank phase figures (what the logging steps gather): a rank
persistently slower than the others' median is named once, with its host and phase;
all ranks slowing together, one slow interval, or an excess that costs nothing is not."""

from __future__ import annotations

import torch

from train.observe.stragglers import StepPhases, Stragglers

HOSTS = ["node-a", "node-a", "node-b", "node-b"]
STEP_S = 0.5   # each interval's step time: ten steps, 5 s
EVERY = 10     # steps per logging interval


def judge(**kw) -> Stragglers:
    return Stragglers(ratio=kw.get("ratio", 1.3), steps=kw.get("steps", 30), hosts=HOSTS)


def normal(data=0.01, compute=0.05) -> list[tuple[float, float]]:
    return [(data, compute)] * 4


def slow(rank: int, data=0.01, compute=0.05) -> list[tuple[float, float]]:
    rows = normal()
    rows[rank] = (data, compute)
    return rows


def run(j: Stragglers, intervals: list[list[tuple[float, float]]], step_s=STEP_S):
    out = []
    for i, rows in enumerate(intervals):
        out += j.observe((i + 1) * EVERY, EVERY, rows, step_s)
    return out


def test_a_rank_slow_in_compute_is_named_once_in_the_window_with_its_host():
    j = judge()  # 30 steps: three intervals of ten
    found = run(j, [normal(), slow(2, compute=0.15), normal(), slow(2, compute=0.16),
                    slow(2, compute=0.15), slow(2, compute=0.15)])
    assert len(found) == 1, found  # at step 40: slow in two of the last three intervals
    f = found[0]
    assert (f.step, f.rank, f.host, f.phase, f.steps) == (40, 2, "node-b", "compute", 30)
    assert 2.9 < f.ratio < 3.1
    line = f.line()
    assert line.startswith("straggler: rank 2 (node-b) is slow in compute: 3.0x the other "
                           "ranks' median (150 vs 50 ms a step) for the last 30 steps"), line
    assert f.record()["event"] == "straggler" and f.record()["rank"] == 2
    assert j.worst == (0.01 + 0.15) / (0.01 + 0.05)  # data and compute together


def test_a_slow_data_source_is_named_as_data():
    found = run(judge(), [slow(1, data=0.09)] * 3)
    assert [(f.rank, f.phase) for f in found] == [(1, "data")], found


def test_all_ranks_slowing_together_is_silent():
    j = judge()
    uniform = [normal(data=0.03, compute=0.15)] * 5
    assert run(j, [normal()] + uniform, step_s=0.6) == []
    assert j.worst == 1.0  # judged, and no rank apart


def test_a_slow_interval_now_and_then_is_no_alarm():
    spikes = [normal(), slow(3, compute=0.5), normal(), normal(), slow(3, compute=0.5),
              normal(), normal(), slow(1, compute=0.5)]
    assert run(judge(), spikes) == []


def test_ranks_slow_by_turns_name_no_one():
    turns = [slow(i % 4, compute=0.3) for i in range(12)]
    assert run(judge(), turns) == []


def test_an_excess_that_costs_under_5_percent_of_a_step_is_silent():
    tiny = [[(0.0, 0.002)] * 3 + [(0.0, 0.006)]] * 25   # 3x, but 4 ms more
    assert run(judge(), tiny, step_s=0.2) == []          # of 200 ms: 2 %
    assert [f.rank for f in run(judge(), tiny, step_s=0.05)] == [3]  # of 50 ms: 8 %


def test_fast_steps_are_judged_over_ten_seconds_not_just_the_steps():
    found = run(judge(), [slow(1, compute=0.15)] * 25, step_s=0.2)  # 2 s an interval
    assert [(f.step, f.steps) for f in found] == [(50, 50)], found     # 10 s: 50 steps


def test_a_named_rank_that_keeps_pace_again_is_said_once():
    found = run(judge(), [slow(2, compute=0.2)] * 3 + [normal()] * 3)
    assert [(f.rank, f.step, f.steps) for f in found] == [(2, 30, 30), (2, 50, 0)], found
    assert found[1].line() == "straggler: rank 2 (node-b) keeps pace again at step 50"
    assert found[1].record()["event"] == "straggler_over"


def test_a_named_rank_near_the_bar_stays_named_until_within_half_the_margin():
    hovering = [slow(2, compute=0.063), slow(2, compute=0.064)] * 3  # 1.26-1.28x: near 1.3
    found = run(judge(), [slow(2, compute=0.2)] * 3 + hovering + [normal()] * 3)
    assert [(f.rank, f.steps > 0) for f in found] == [(2, True), (2, False)], found
    assert found[1].step == 110  # cleared once back under 1.15x, never re-named
    assert run(judge(), hovering) == []  # the same figures never name a rank not named


def test_off_and_alone_say_nothing():
    assert run(judge(ratio=0), [slow(2, compute=0.5)] * 5) == []
    alone = Stragglers(ratio=1.3, steps=20, hosts=["a"])
    assert alone.observe(30, 10, [(0.5, 0.5)], 1.0) == []


def test_the_phase_clock_counts_what_runs_inside_it_and_starts_again():
    phases = StepPhases(torch.device("cpu"))
    def matmuls():
        x = torch.randn(256, 256)
        for _ in range(20):
            x = x @ x.T / 256
        return x

    assert phases.next_batch(iter([7])) == 7
    assert phases.forward(matmuls).shape == (256, 256)
    data_s, compute_s = phases.take()
    assert data_s > 0 and compute_s > 0
    assert phases.take() == (0.0, 0.0)


def test_each_ranks_others_median_is_the_median_without_it():
    import random
    import statistics

    from train.observe.stragglers import _median_without
    rng = random.Random(0)
    for n in (2, 3, 4, 7, 64):
        values = [rng.choice((0.1, 0.2, 0.5, rng.random())) for _ in range(n)]
        ordered = sorted(values)
        for r, v in enumerate(values):
            assert _median_without(ordered, v) == statistics.median(values[:r] + values[r + 1:])
