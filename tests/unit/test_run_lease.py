"""The run directory's lease (train/core/run/runlock.py), with real processes and files: a
live lease of another job makes a launch wait, then exit 6 (retryable); a dead holder
here is taken over at once, one on another host once its lease expires; members of one
job never refuse each other, however many start at once. A launch whose lease was taken
over stops without writing more: tests/e2e/test_run_lease_runs.py.

"Another host" is a process in UTS and PID namespaces of its own (its own hostname and
process numbers) sharing the run directory, as pods on two nodes share a volume.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launcher.conventions.slurm import earlier_incarnation
from tests.harness.runs import ROOT, clean_env, limit
from train.core.errors import EXIT_RUN_DIR_BUSY, RunDirBusy
from train.core.run import runlock

FAST = runlock.LeaseTimes(renew_s=0.3, expiry_s=2.0, wait_s=1.0)
HOLD = """import sys, time
from pathlib import Path
from train.core.run import runlock
times = runlock.LeaseTimes(renew_s=0.3, expiry_s=2.0, wait_s=5.0)
lock = runlock.acquire(Path(sys.argv[1]), sys.argv[2], times)
print("held", flush=True)
time.sleep(float(sys.argv[3]))
lock.release()
print("released", flush=True)
time.sleep(60)
"""


def holder(run: Path, job: str, hold_s: float = 120, prefix: list[str] = ()) -> subprocess.Popen:
    proc = subprocess.Popen([*prefix, sys.executable, "-c", HOLD, str(run), job, str(hold_s)],
                            cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=limit(30))


def test_a_live_lease_of_another_job_makes_a_launch_wait_then_exit_6(tmp_path):
    run = tmp_path / "run"
    other = holder(run, "job-a")
    said: list[str] = []
    try:
        t0 = time.monotonic()
        with pytest.raises(RunDirBusy) as busy:
            runlock.acquire(run, "job-b", FAST, log=said.append)
        assert time.monotonic() - t0 >= FAST.wait_s  # it waited
        assert busy.value.exit_code == EXIT_RUN_DIR_BUSY == 6
        line = busy.value.one_line()
        assert f"in use by job job-a (pid {other.pid} on {socket.gethostname()}; renewed 0 s " \
               "ago), still after 1 s (run.lock_wait_s)" in line, line
        assert said and said[0].startswith(f"waiting up to 1 s for the run directory {run}")
        member = runlock.acquire(run, "job-a", FAST)  # another node of the same job
        assert member.fd is None  # the holder's process keeps the flock
        member.release()
    finally:
        stop(other)


def test_a_waiting_launch_takes_over_once_the_holder_releases(tmp_path):
    run = tmp_path / "run"
    other = holder(run, "job-a", hold_s=1.0)
    try:
        lock = runlock.acquire(run, "job-b", runlock.LeaseTimes(0.3, 2.0, wait_s=20))
        assert json.loads((run / ".lock").read_text())["job"] == "job-b"
        assert other.stdout.readline().strip() == "released"
        lock.release()
    finally:
        stop(other)


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path):
    run = tmp_path / "run"
    other = holder(run, "job-a")
    stop(other)  # kill -9: its lease says it still holds the run
    said: list[str] = []
    t0 = time.monotonic()
    lock = runlock.acquire(run, "job-b", FAST, log=said.append)
    assert time.monotonic() - t0 < FAST.expiry_s
    assert said == [f"taking over the run directory {run} from job job-a (pid {other.pid} "
                    f"on {socket.gethostname()}; renewed 0 s ago)"]
    lock.release()


def another_host(name: str) -> list[str]:
    probe = subprocess.run(["unshare", "--uts", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"no rights for UTS and PID namespaces: {probe.stderr.decode().strip()}")
    return ["unshare", "--uts", "--pid", "--fork", "--kill-child", "sh", "-c",
            f'hostname {name} && exec "$@"', "sh"]


def test_a_vanished_hosts_lease_is_taken_over_when_it_expires(tmp_path):
    """The holder on another host dies with its host: no process here can check it, so
    its lease counts until it expires (run.lock_expiry_s without a renewal)."""
    run = tmp_path / "run"
    other = holder(run, "job-a", prefix=another_host("host-a"))
    held = json.loads((run / ".lock").read_text())
    assert held["host"] == "host-a"
    stop(other)
    said: list[str] = []
    t0 = time.monotonic()
    lock = runlock.acquire(run, "job-b", runlock.LeaseTimes(0.3, 2.0, wait_s=30),
                           log=said.append)
    waited = time.monotonic() - t0
    assert 0.5 < waited < 20, waited
    (takeover,) = [s for s in said if s.startswith("taking over")]
    assert takeover.startswith(f"taking over the run directory {run} from job job-a (pid "
                               f"{held['pid']} on host-a; renewed "), takeover
    assert json.loads((run / ".lock").read_text())["job"] == "job-b"
    lock.release()


def test_a_requeued_slurm_job_takes_its_earlier_incarnations_lease_at_once(tmp_path):
    """SLURM starts a requeued job's next incarnation only once the last one ended, so
    that one's lease (here: killed on another host, never released, its expiry far off)
    is taken over at once; another job's lease in the same state is still waited for."""
    times = runlock.LeaseTimes(renew_s=10, expiry_s=600, wait_s=1.0)
    for case, (old, new, taken) in enumerate( (("slurm-77.0", "slurm-77.0-requeue1", True),
                            ("slurm-77.batch-requeue1", "slurm-77.0-requeue2", True),
                            ("slurm-78.0", "slurm-77.0-requeue1", False),
                            ("slurm-77.0-requeue2", "slurm-77.0-requeue1", False))):
        run = tmp_path / f"run{case}"
        other = holder(run, old, prefix=another_host("host-a"))
        stop(other)
        said: list[str] = []
        ended = earlier_incarnation(new)
        if not taken:
            with pytest.raises(RunDirBusy):
                runlock.acquire(run, new, times, log=said.append, ended=ended)
            continue
        lock = runlock.acquire(run, new, times, log=said.append, ended=ended)
        assert said[-1].endswith("; an earlier incarnation of this job)"), said
        assert f"from job {old} (pid " in said[-1]
        lock.release()



def test_a_requeued_job_waits_only_while_its_earlier_incarnation_still_runs_here(tmp_path):
    """The earlier incarnation's process on this host has not exited yet (SLURM counts a
    job ended before all its processes are gone): the next one waits for it, saying so,
    and takes the lease over as soon as it is gone, not when the lease expires."""
    run = tmp_path / "run"
    other = holder(run, "slurm-77.0")
    said: list[str] = []
    times = runlock.LeaseTimes(renew_s=10, expiry_s=600, wait_s=limit(60))
    threading.Timer(1.0, stop, [other]).start()
    lock = runlock.acquire(run, "slurm-77.0-requeue1", times, log=said.append,
                           ended=earlier_incarnation("slurm-77.0-requeue1"))
    lock.release()
    assert said[0].startswith("waiting up to") and \
        said[0].endswith("; a process of it on this host is still running)"), said
    assert said[-1].endswith("; an earlier incarnation of this job)"), said

STARTER = """import sys, time
from pathlib import Path
from train.core.run import runlock
from train.core.errors import RunDirBusy
run, go, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
times = runlock.LeaseTimes(renew_s=0.5, expiry_s=5.0, wait_s=0.0)
while not go.exists():
    time.sleep(0.001)
for r in range(rounds):
    try:
        lock = runlock.acquire(run, "job-x", times)
        print("ok", flush=True)
        time.sleep(0.05)
        lock.release()
    except RunDirBusy as exc:
        print("refused", exc, flush=True)
    while not Path(f"{go}.{r + 1}").exists():
        time.sleep(0.001)
"""


def test_two_hundred_simultaneous_starts_of_one_job_never_refuse(tmp_path):
    """Members of one run (the same rendezvous id) starting in the same instant; and a
    reader that never finds the lease empty or half-written while they write it."""
    run, go = tmp_path / "run", tmp_path / "go"
    procs, rounds = 40, 5
    starters = [subprocess.Popen([sys.executable, "-c", STARTER, str(run), str(go),
                                  str(rounds)], cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)),
                                 stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    torn: list[str] = []
    done = threading.Event()

    def read_all_the_time() -> None:
        while not done.is_set():
            try:
                text = (run / ".lock").read_text()
            except FileNotFoundError:
                continue
            try:
                json.loads(text)
            except ValueError:
                torn.append(text)
    reader = threading.Thread(target=read_all_the_time)
    reader.start()
    try:
        time.sleep(3)  # every starter has imported and waits
        go.touch()
        for r in range(1, rounds + 1):
            time.sleep(0.5)
            Path(f"{go}.{r}").touch()
        outputs = [p.communicate(timeout=limit(120))[0] for p in starters]
    finally:
        done.set()
        reader.join()
        for p in starters:
            if p.poll() is None:
                p.kill()
    answers = [line for out in outputs for line in out.splitlines()]
    assert len(answers) == procs * rounds
    assert [a for a in answers if a != "ok"] == []
    assert torn == []
