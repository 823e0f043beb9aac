"""The hang watchdog watches steps, evaluation and checkpoints alike: a phase whose parts
keep saying they progressed lives on however long it takes, one that stops is named
with its phase. Each case is a real process (the watchdog ends its process); a background
checkpoint's writer, watched on its own, with two real processes over gloo."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

from launcher.detection.system import free_port
from tests.harness.runs import limit, worker_env
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


BACKGROUND = textwrap.dedent("""\
    import datetime, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from train.checkpoint import sharded
    from train.checkpoint.store import Checkpointer
    from train.core import bulk
    from train.guards.watchdog import CHECKPOINT, Watchdog
    rank, port, work, fmt = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    # the collectives' own timeout far away: what ends a rank here is its watchdog
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=120))

    def gather(value):
        out = [None, None]
        dist.all_gather_object(out, value)
        return out

    def hang(self, data):  # rank 1's disk stops answering
        time.sleep(3600)

    if rank == 1:
        bulk.BulkFile.write = hang
    if fmt == "sharded":  # DCP's import and its group, as a run has them by its first
        import torch.distributed.checkpoint  # save: no part of the watched save here
        sharded.writer_group()
    w = Watchdog(15)  # 80 %: a checkpoint part silent 12 s is a hang
    c = Checkpointer(work, rank=rank, keep_last=2, world_size=2, gather=gather)
    model = torch.nn.Linear(64, 64)
    shards = (lambda folder: sharded.save_in_background({"model": model.state_dict()},
                                                        folder)) if fmt == "sharded" else None
    for step in range(1, 100000):
        w.pet(step)
        x = torch.ones(4)
        dist.all_reduce(x)  # a step: the ranks still reach each other
        if step == 5:
            with w.watching(CHECKPOINT, step):
                c.save(step, {"step": step}, {"rng": rank}, background=True, shards=shards,
                       watchdog=w)
        print(f"step {step}", flush=True)
        time.sleep(0.2)
    """)


def _pair(work, fmt: str) -> list[subprocess.Popen]:
    port = free_port()
    work.mkdir()
    return [subprocess.Popen([sys.executable, "-c", BACKGROUND, str(r), str(port), str(work),
                              fmt], env=worker_env(), text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE) for r in range(2)]


def test_a_background_checkpoint_blocked_on_a_peer_is_named_while_steps_go_on(tmp_path):
    """Rank 1's disk hangs while its background save writes (its DCP thread's, sharded;
    its writer thread's, full): rank 0's writer waits for it (DCP's collective over the
    writer group; rank 1's marker file) while both training threads keep stepping
    together. Without a watch on the writer nothing would say so before the next save
    or the collective's own timeout; with it, a rank names the background checkpoint.
    Both formats at once (two pairs of processes), each pair on its own port."""
    pairs = {fmt: _pair(tmp_path / fmt, fmt) for fmt in ("full", "sharded")}
    try:
        outs = {fmt: [p.communicate(timeout=limit(120)) for p in procs]
                for fmt, procs in pairs.items()}
    finally:
        for p in [p for procs in pairs.values() for p in procs]:
            p.kill()
    for fmt, procs in pairs.items():
        assert [p.returncode for p in procs] != [0, 0]
        _named_the_background_checkpoint(fmt, outs[fmt])
        steps = [int(n) for n in re.findall(r"step (\d+)", outs[fmt][0][0])]
        assert max(steps) >= 15, outs[fmt][0][0][-500:]  # training went on meanwhile
        assert not (tmp_path / fmt / "checkpoints" / "latest").exists()


def _named_the_background_checkpoint(fmt: str, outs: list[tuple[str, str]]) -> None:
    said = {r: re.search(r"hang watchdog: no progress for \d+ s in the background checkpoint "
                         r"of step 5 \(80% of distributed.timeout_s: 12 s\): (.*?); every", err)
            for r, (_, err) in enumerate(outs)}
    assert said[0] or said[1], (fmt, [err[-2000:] for _, err in outs])
    if said[0]:  # rank 0 waits for rank 1 (whichever rank is named first ends the pair)
        assert said[0][1].startswith(
            "waiting for the other ranks (a collective) at " if fmt == "sharded" else
            "waiting for rank 1 to write checkpoints/step-5.partial at store.py:"), said[0][1]
    if said[1]:  # rank 1 is stuck in its write
        assert said[1][1].startswith("stuck in its own code at <string>:") and \
            said[1][1].endswith(" in hang"), said[1][1]
