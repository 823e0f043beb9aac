"""The supervisor: exit-code mapping, signal forwarding, restarts — with a stand-in
worker (tests/harness/supervision.py; gloo-free, so a few seconds each). Two workers
under real torchrun: tests/e2e/test_launcher_supervise_runs.py."""

from __future__ import annotations

import dataclasses
import signal
import sys
import time

from launcher.running.supervise import classify
from tests.harness.runs import limit
from tests.harness.supervision import start, wait_ready
from train.core.errors import EXIT_ONLY_LOCAL
from train.core.run import protocol
from train.core.run.protocol import Exit, Report, restart_can_help


def rep(rank: int, code: int, error: str | None = None, restart: int = 0,
        time: float = 0.0) -> Report:
    return Report(rank=rank, exit_code=code, error=error, restart=restart, time=time,
                  log_dir=f"/runs/x/logs/a/attempt_0/{rank}")


# ------------------------------------------------------------------------- classify

def test_all_done_is_0():
    assert classify(0, [rep(0, 0), rep(1, 0)], [], 2, "torchrun").code == 0


def test_done_with_the_final_checkpoint_only_local_is_7_with_rank_0s_line():
    """The workers exit 0 (torchrun must not restart a finished run); the launcher's code
    tells a Job or a requeue to run it again on the same disk, which uploads it."""
    line = "error: the run finished, but its final checkpoint step-4 is only on this disk"
    left = dataclasses.replace(rep(0, 0), only_local=line)
    out = classify(0, [left, rep(1, 0)], [], 2, "torchrun")
    assert (out.code, out.message) == (EXIT_ONLY_LOCAL, line)
    assert restart_can_help(EXIT_ONLY_LOCAL)
    assert classify(0, [left], [], 1, "direct").code == EXIT_ONLY_LOCAL


def test_failure_names_the_first_failing_rank_and_its_log():
    out = classify(1, [rep(0, 0), rep(1, 1, "ValueError: bad"), rep(2, 1, "x")], [], 3,
                   "torchrun")
    assert out.code == 1
    assert out.message == ("error: training failed: rank 1: ValueError: bad (1 more rank(s) "
                           "failed); details in its log /runs/x/logs/a/attempt_0/1/stderr.log")


def test_sigterm_with_every_checkpoint_confirmed_is_143():
    out = classify(1, [rep(0, 143), rep(1, 143)], [signal.SIGTERM], 2, "torchrun")
    assert out.code == 143 and "SIGTERM" in out.message and "confirmed" not in out.message


def test_a_static_job_ending_with_another_nodes_stop_is_143_and_says_why():
    """Workers that stopped because another node's were told to (exit 144, between worker
    and launcher only) are stopped, not failed: the user sees 143."""
    out = classify(1, [rep(0, 144), rep(1, 144)], [], 2, "torchrun")
    assert out.code == 143
    assert out.message.startswith("stopped by another node's stop (its workers got a signal)")


def test_sigterm_without_reports_is_still_143_but_says_so():
    out = classify(1, [], [signal.SIGTERM], 2, "torchrun")
    assert out.code == 143 and "0 of 2" in out.message


def test_signal_during_last_step_that_finished_is_0():
    assert classify(0, [rep(0, 0)], [signal.SIGINT], 1, "direct").code == 0


def test_torchrun_failing_before_workers_is_1():
    out = classify(1, [], [], 2, "torchrun")
    assert out.code == 1 and "before any worker reported" in out.message


def test_worker_killed_without_report_is_1():
    out = classify(-9, [], [], 1, "direct")
    assert out.code == 1 and "SIGKILL" in out.message and "out of memory" in out.message


def test_worker_exit_2_or_3_passes_through():
    assert classify(3, [rep(0, 3)], [], 1, "direct").code == 3


def test_a_worker_error_kept_off_the_console_is_said_once_naming_rank_and_file():
    """Every rank met the same config error and kept it in its log folder
    (train.core.run.failure_log): the one line is that error, the first rank and its file."""
    said = "error: run.yaml: data.factory: make(**data.args) failed: ValueError: no table"
    kept = [dataclasses.replace(rep(r, 2, said, time=t),
                                details=f"/runs/x/logs/a/attempt_0/{r}/traceback.log")
            for r, t in ((0, 2.0), (1, 1.0))]
    out = classify(1, kept, [], 2, "torchrun")
    assert out.code == 2
    assert out.message == f"{said} (rank 1 failed first; details in its log " \
                          "/runs/x/logs/a/attempt_0/1/traceback.log)"
    failed = classify(1, [dataclasses.replace(rep(0, 1, "ValueError: bad"),
                                              details="/logs/0/traceback.log")], [], 2,
                      "torchrun")
    assert failed.message.endswith("ValueError: bad; details in its log /logs/0/traceback.log")


def test_older_restart_rounds_are_ignored(tmp_path):
    from launcher.running.supervise import read_reports
    from train.core.run import protocol
    for r in (rep(0, 1, "old", restart=0), rep(1, 0, restart=1)):
        protocol.write(tmp_path, r)
    (tmp_path / "rank-2.json").write_text("{torn")  # a half-written file is skipped
    assert [r.rank for r in read_reports(tmp_path)] == [1]


GLOO_RESET = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:38307: Connection reset by peer")


def test_a_worker_killed_by_a_signal_is_named_not_the_rank_that_lost_it():
    """torchrun saw rank 1 end by SIGKILL first (no report of its own: it was killed); rank 0
    then failed on the closed connection and torchrun stopped it (SIGTERM)."""
    exits = [Exit(0, 0, -15, first=False, log_dir="/logs/attempt_0/0"),
             Exit(1, 1, -9, first=True, log_dir="/logs/attempt_0/1")]
    out = classify(1, [rep(0, 1, GLOO_RESET), _training(1, 7)], [], 2, "torchrun",
                   exits=exits)
    assert out.code == 1
    assert out.message == ("error: training failed: rank 1 killed by SIGKILL (often out of "
                           "memory: dmesg, kubectl describe pod; or a kill -9); 1 more rank(s) "
                           "failed after it; details in its log /logs/attempt_0/1/stderr.log")
    script = classify(1, [], [], 2, "torchrun", "script", exits=exits, host="node2")
    assert script.message.startswith("error: the script failed: rank 1 on node2 killed by "
                                     "SIGKILL"), script.message


def test_torchruns_own_stop_of_the_others_is_no_death():
    """Rank 1 failed with its error; torchrun then stopped rank 0 (SIGTERM, or SIGKILL after
    its timeout): rank 1 is named, with its error. On a torch that does not say which
    ended first, a SIGTERM is taken for torchrun's stop."""
    failed = rep(1, 1, "ValueError: bad batch")
    for exits in ([Exit(0, 0, -9, first=False), Exit(1, 1, 1, first=True)],
                  [Exit(0, 0, -15), Exit(1, 1, 1)]):
        out = classify(1, [failed], [], 2, "torchrun", exits=exits)
        assert out.message.startswith("error: training failed: rank 1: ValueError: bad "
                                      "batch; details in its log"), out.message


def test_a_rank_that_only_lost_its_peer_elsewhere_is_not_blamed():
    """Another node's worker died: this node knows only that rank 0 lost it."""
    out = classify(1, [rep(0, 1, GLOO_RESET), rep(1, 143)], [], 2, "torchrun")
    assert out.message.startswith("error: training failed: a worker died, or its node did: "
                                  "rank 0 lost the connection to the worker at "
                                  "127.0.0.1:38307; that worker's own log says why"), out.message


def test_a_failed_attempt_is_said_in_the_words_of_the_failure_line():
    from launcher.endings.restarts import failed_attempt, restarting
    killed = failed_attempt([rep(0, 1, GLOO_RESET)], [Exit(1, 1, -9, first=True)], 2)
    assert restarting(killed[0], 1, 2) == ("rank 1 killed by SIGKILL (often out of memory: "
                                           "dmesg, kubectl describe pod; or a kill -9); "
                                           "restarting the workers (1 of 2)")
    assert killed[1] is False
    assert failed_attempt([rep(0, 1, "ValueError: x")], [Exit(0, 0, 1, first=True)], 1) == \
        ("rank 0 failed: ValueError: x", False)
    assert failed_attempt([rep(0, 2, "error: c.yaml: optim.lr: must be > 0")], [], 1)[1]


def test_workers_the_launcher_stopped_are_said_once_as_its_stop(tmp_path):
    """A node left the job and the launcher killed this node's workers: torchrun's agent
    says why once, not "killed by SIGKILL (often out of memory)"."""
    from launcher.endings.restarts import note_stop, take_stop_note
    note_stop(str(tmp_path), "node(s) b:7 left the job (silent for 8 s)")
    assert take_stop_note(str(tmp_path)) == "node(s) b:7 left the job (silent for 8 s)"
    assert take_stop_note(str(tmp_path)) is None and take_stop_note(None) is None


def test_a_final_verdict_stands_when_the_launcher_also_stopped_the_workers():
    """A peer node left (its workers found the job cannot run: exit 3) and the launcher
    killed this node's workers, which had reached the same verdict: no restart, which
    would wait for the peer in vain. Without a verdict of their own, the stop is said."""
    from launcher.endings.restarts import attempt_verdict
    note = "node(s) b:7 left the job (silent for 8 s)"
    cannot = rep(0, 3, "CannotRunHere: the run directory is not shared by the job's nodes")
    what, final, stopped = attempt_verdict([cannot], [Exit(0, 0, 3, first=True)], 1, "a", note)
    assert final and not stopped and "not shared" in what
    killed = attempt_verdict([], [Exit(0, 0, -9, first=True)], 1, "a", note)
    assert killed == (f"{note}: the launcher stopped this node's workers", False, True)
    assert attempt_verdict([], [Exit(0, 0, -9, first=True)], 1, "a", None)[2] is False


def test_only_the_attempt_the_reports_belong_to_is_read(tmp_path):
    """A failed attempt recorded before a restart that then ended otherwise says nothing
    of that ending."""
    protocol.record_attempt(tmp_path, protocol.Attempt(0, [Exit(1, 1, -9, True)], "h", 1, True))
    (attempt,) = protocol.attempts(tmp_path)
    assert attempt.exits == [Exit(1, 1, -9, True)] and attempt.restarting
    assert protocol.last_attempt(tmp_path, [rep(0, 0, restart=1)]) is None
    assert protocol.last_attempt(tmp_path, [rep(0, 1, restart=0)]) == attempt
    assert protocol.last_attempt(tmp_path, []) == attempt


# -------------------------------------------------------------------- real processes

def test_sigint_in_direct_mode_is_143(tmp_path):
    proc = start("sigterm", 1, tmp_path)
    wait_ready(tmp_path, 1, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=limit(30))
    assert proc.returncode == 143, err


def test_direct_mode_restarts_then_fails(tmp_path):
    proc = start("crash", 1, tmp_path, restarts=2)
    _, err = proc.communicate(timeout=limit(60))
    assert proc.returncode == 1
    said = [line for line in err.splitlines() if "restarting" in line]
    assert said == [f"entrypoint: rank 0 exited with code 7 without a report of its own (a crash "
                    f"in native code, or os._exit); restarting the worker ({n} of 2)"
                    for n in (1, 2)], err
    assert err.strip().splitlines()[-1].startswith(
        "error: training failed: rank 0 exited with code 7 without a report of its own")


def test_direct_mode_success_is_0(tmp_path):
    proc = start("ok", 1, tmp_path, restarts=2)
    _, err = proc.communicate(timeout=limit(30))
    assert proc.returncode == 0
    assert "error" not in err and "restart" not in err.replace("RESTART_COUNT", "")


def test_the_earliest_failure_is_named_not_the_lowest_rank():
    reports = [rep(0, 1, "DistBackendError: connection closed", time=20.0),
               rep(1, 1, "torch.OutOfMemoryError: CUDA out of memory", time=10.0)]
    out = classify(1, reports, [], 2, "torchrun")
    assert "rank 1: torch.OutOfMemoryError" in out.message


def _training(rank: int, step: int) -> Report:
    """A rank's progress report: last seen training at ``step``, no end written."""
    return Report(rank=rank, local_rank=rank, stage="training", step=step)


def _hung(rank: int, kind: str, at: str, t: float) -> Report:
    return Report(rank=rank, local_rank=rank, exit_code=1, time=t,
                  error=f"no progress for 30 s in step 8: {kind} at {at}",
                  step=7, hung={"waits": "ranks"}.get(kind, kind))


def test_a_hang_names_the_rank_the_others_waited_for_not_the_first_to_time_out():
    waiting = _hung(0, "waits", "stopping.py:50 in agreed", t=1.0)  # reported first
    culprit = _hung(1, "own", "mydata.py:12 in __getitem__", t=2.0)
    out = classify(1, [waiting, culprit], [], 2, "torchrun")
    assert out.code == 1
    assert out.message.startswith("error: training failed: rank 1 hung: no progress")
    assert "mydata.py:12 in __getitem__" in out.message
    assert "rank(s) 0 waited for it" in out.message
    loader = _hung(1, "loader", "trainer.py:90 in train_step", t=2.0)
    assert "rank 1 hung" in classify(1, [waiting, loader], [], 2, "torchrun").message


def test_a_rank_that_wrote_nothing_more_is_named_when_the_others_timed_out():
    """Frozen or SIGSTOPped: no watchdog of its own ran; its report says step 7."""
    timed_out = Report(rank=0, local_rank=0, exit_code=1, time=1.0,
                       error="DistBackendError: [../gloo/transport/tcp/unbound_buffer.cc:81] "
                             "Timed out waiting 30000ms for recv operation to complete")
    out = classify(1, [timed_out, _training(1, 7)], [], 2, "torchrun")
    assert out.message.startswith("error: training failed: rank 1 stopped making progress "
                                  "(its last progress report: step 7) and wrote nothing more")
    assert "rank 0 timed out waiting for it" in out.message
    # a rank that crashed is still the root cause: the others' progress reports say nothing
    crashed = Report(rank=0, local_rank=0, exit_code=1, error="ValueError: bad batch")
    plain = classify(1, [crashed, _training(1, 7)], [], 2, "torchrun")
    assert plain.message.startswith("error: training failed: rank 0: ValueError: bad batch")


def test_torchrun_killed_during_training_is_not_called_a_startup_failure():
    out = classify(-9, [_training(0, 110), _training(1, 110)], [], 2, "torchrun")
    assert "before any worker reported" not in out.message
    assert "while training (at step 110 or later: ranks report their step about once a " \
        "second)" in out.message and "kill -9" in out.message  # a report may lag short steps


def test_the_watchdog_says_what_a_stuck_thread_waits_for():
    """From real stacks (a collective's: tests/e2e/test_hangs.py); the limit it watches."""
    import queue
    import threading

    from train.guards.watchdog import Watchdog, where
    caught: dict[str, object] = {}

    def grab(name):
        caught[name] = sys._getframe(1)

    def own_code():
        grab("own")
    own_code()
    assert where(caught["own"]) == ("own", f"test_launcher_supervise.py:"
                                           f"{own_code.__code__.co_firstlineno + 1} in own_code")
    q = queue.Queue()
    threading.Thread(target=lambda: (time.sleep(0.2), q.put(1)), daemon=True).start()
    frames = []
    t = threading.Thread(target=lambda: frames.append(q.get()), daemon=True)
    t.start()
    time.sleep(0.05)
    kind, _ = where(sys._current_frames()[t.ident])
    assert kind == "own"  # Python's own queue is no DataLoader
    w = Watchdog(600)
    w.pace(0.01)
    assert w.limit == 120  # the floor for quick steps
    w.pace(60)
    assert w.limit == 480  # 80 % of distributed.timeout_s: before the collectives time out
