"""The hang watchdog watches steps, evaluation and checkpoints alike: a phase whose parts
keep saying they progressed lives on however long it takes, one that stops is named
with its phase. Each case is a real process (the watchdog ends its process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.harness.runs import limit
from train.guards.watchdog import SLOW_DISK_BYTES_S, Watchdog


def _run(body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent("""\
        import time
        from train.guards.watchdog import CHECKPOINT, EVALUATION, PREFLIGHT, Watchdog
        w = Watchdog(5)  # 80 % of it: a part silent 4 s is a hang
        w.pet(7)
        """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=limit(120))


def test_a_checkpoint_that_keeps_progressing_outlives_the_limit_then_a_stuck_step_is_named():
    out = _run("""\
        with w.watching(CHECKPOINT, 7):
            for _ in range(20):       # 10 s in all, 0.5 s between parts
                time.sleep(0.5)
                w.progress()
        print("checkpoint done", flush=True)
        w.pet(7)
        time.sleep(60)
        """)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "checkpoint done" in out.stdout
    assert "hang watchdog: no progress for" in out.stderr
    assert " in step 8 (80% of distributed.timeout_s: 4 s): stuck in its own code" \
        in out.stderr, out.stderr[-2000:]


def test_a_stuck_evaluation_checkpoint_and_preflight_check_are_named_by_their_phase():
    for phase, words in (("EVALUATION", "in the evaluation after step 7"),
                         ("CHECKPOINT", "in the checkpoint of step 7"),
                         ("PREFLIGHT", "in the preflight check before training")):
        out = _run(f"""\
            with w.watching({phase}, 7):
                time.sleep(60)
            """)
        assert out.returncode == 1, out.stderr[-2000:]
        assert f"{words} (80% of distributed.timeout_s: 4 s): stuck in its own code at " \
               "<string>:" in out.stderr, out.stderr[-2000:]


def test_after_a_phase_the_rest_of_the_step_is_watched_until_a_pause():
    out = _run("""\
        with w.watching(EVALUATION, 8):
            w.progress()
        w.pause()
        time.sleep(8)               # paused: twice the limit, nothing said
        w.progress()                # paused: no effect
        time.sleep(8)
        print("alive", flush=True)
        w.pet(8)
        with w.watching(EVALUATION, 9):
            w.progress()
        time.sleep(60)              # the stop agreement after an evaluation: watched
        """)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "alive" in out.stdout
    assert " in step 9 (80% of distributed.timeout_s: 4 s): stuck in its own code" \
        in out.stderr, out.stderr[-2000:]


def test_the_preflight_check_is_allowed_the_floor_per_part_within_the_cap():
    out = _run("""\
        w = Watchdog(600)
        with w.watching(PREFLIGHT, 0):
            print(w.watched, flush=True)
        w.pause()
        w = Watchdog(20)
        with w.watching(PREFLIGHT, 0):
            print(w.watched, flush=True)
        w.pause()
        """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["120", "16.0"]


def test_a_checkpoint_may_take_as_long_as_its_state_written_slowly_within_the_cap():
    big = Watchdog(600, state_bytes=int(200 * SLOW_DISK_BYTES_S))
    big.pace(0.01)
    assert big.limit == 120                  # a step: the floor
    assert big.checkpoint_limit() == 200     # its state at the slow disk's rate
    huge = Watchdog(600, state_bytes=int(1000 * SLOW_DISK_BYTES_S))
    huge.pace(0.01)
    assert huge.checkpoint_limit() == huge.cap == 480  # never past the collectives' timeout
