"""Never lose work, across processes: workers never outlive a killed launcher, a lost
worker of a 2-process node recovered bitwise, a second launch of a running run waits
then exits 6, SIGTERM to the launcher's process group on two processes. Real processes
throughout (entrypoint.py, torchrun with gloo). One process: tests/unit/test_safety.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.harness.procs import alive, cmdline, descendants, environ, worker_of_rank
from tests.harness.runs import (
    ENTRY,
    ROOT,
    SMALL,
    clean_env,
    entry,
    failure_lines,
    last_line,
    limit,
    losses,
    wait_for,
)
from tests.harness.stops import sigterm_to_the_launchers_group

# ---------------------------------------------------------------- supervision

@pytest.mark.parametrize("nproc", [1, 2])
def test_workers_never_outlive_the_launcher(tmp_path, nproc):
    """kill -9 of the launcher: its workers get SIGTERM, checkpoint and exit; a rerun resumes."""
    log = (tmp_path / "out.log").open("w")
    cmd = [sys.executable, ENTRY, "train", str(ROOT / "configs" / "quickstart.yaml"), *SMALL,
           f"distributed.nproc_per_node={nproc}", "train.max_steps=100000",
           f"output.dir={tmp_path / 'runs'}"]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=clean_env(), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "step 5/" in (tmp_path / "out.log").read_text(), 180, "no training")
        below = descendants(launcher.pid)
        assert below
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not any(alive(p) for p in below), 60, "workers outlived the launcher")
    finally:
        for pid in [p for p in below if alive(p)] if "below" in locals() else []:
            os.kill(pid, signal.SIGKILL)
    assert (tmp_path / "runs" / "quickstart" / "checkpoints" / "latest").exists()
    rerun = entry("train", str(ROOT / "configs" / "quickstart.yaml"), *SMALL,
                  f"distributed.nproc_per_node={nproc}", "train.max_steps=2",
                  f"output.dir={tmp_path / 'runs'}", cwd=tmp_path, timeout=240)
    assert rerun.returncode == 0 and "nothing to do" in rerun.stdout + rerun.stderr


def is_local_rank_1(pid: int) -> bool:
    return "train.worker" in cmdline(pid) and environ(pid).get("LOCAL_RANK") == "1"


def test_two_process_node_recovers_from_a_lost_worker_bitwise(tmp_path):
    """kill -9 of local rank 1 after a checkpoint: torchrun restarts both, they resume,
    and the run ends with the losses of an uninterrupted one. Rank 1 is found while the
    run is young and killed at its first checkpoint; with a checkpoint every other step
    (each written durably) the run is still far from its end then, on any machine."""
    args = [str(ROOT / "configs" / "quickstart.yaml"), *SMALL, "distributed.nproc_per_node=2",
            "train.max_steps=40", "checkpoint.every_steps=2", "logging.every_steps=1"]
    reference = entry("train", *args, f"output.dir={tmp_path / 'ref'}", cwd=tmp_path, timeout=240)
    assert reference.returncode == 0, reference.stderr[-3000:]
    log = (tmp_path / "out.log").open("w")
    launcher = subprocess.Popen([sys.executable, ENTRY, "train", *args,
                                 f"output.dir={tmp_path / 'run'}"], cwd=tmp_path,
                                env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        text = lambda: (tmp_path / "out.log").read_text()  # noqa: E731
        rank1: list[int] = []
        def found() -> bool:
            rank1[:] = [p for p in descendants(launcher.pid) if is_local_rank_1(p)]
            return len(rank1) == 1
        wait_for(found, 180, "no worker of local rank 1")
        wait_for(lambda: "checkpoint saved" in text(), 180, "no checkpoint")
        os.kill(rank1[0], signal.SIGKILL)
        assert launcher.wait(timeout=limit(240)) == 0, text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert "resumed from" in text()
    assert losses(tmp_path / "run" / "quickstart") == losses(tmp_path / "ref" / "quickstart")
    # the restart is one line naming the killed rank; rank 0's traceback stays in its log
    assert "torchrun: rank 1 killed by SIGKILL (often out of memory" in text()
    assert "restarting the workers (1 of 3)" in text() and "Traceback" not in text()


def test_a_killed_rank_is_named_not_the_survivor_under_fsdp(tmp_path):
    """kill -9 of rank 1 under FSDP with async sharded saves, no restart: the last line
    names rank 1 and SIGKILL with its log, not rank 0 that lost its connection to it, and
    no traceback reaches the console, nor rank 0's stop."""
    log = (tmp_path / "out.log").open("w")
    launcher = subprocess.Popen(
        [sys.executable, ENTRY, "train", str(ROOT / "configs" / "quickstart.yaml"), *SMALL,
         "distributed.nproc_per_node=2", "distributed.strategy=fsdp",
         "distributed.max_restarts=0", "checkpoint.format=sharded", "checkpoint.async_save=true",
         "checkpoint.every_steps=1", "train.max_steps=100000",
         f"output.dir={tmp_path / 'runs'}"], cwd=tmp_path, env=clean_env(), stdout=log,
        stderr=subprocess.STDOUT)
    text = lambda: (tmp_path / "out.log").read_text()  # noqa: E731
    try:
        latest = tmp_path / "runs" / "quickstart" / "checkpoints" / "latest"
        wait_for(lambda: latest.exists(), 180, "no checkpoint")  # a save every step
        os.kill(worker_of_rank(launcher.pid, "1"), signal.SIGKILL)
        assert launcher.wait(timeout=limit(120)) == 1, text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert last_line(text()).startswith("error: training failed: rank 1 killed by SIGKILL "
                                        "(often out of memory"), text()[-3000:]
    assert last_line(text()).endswith("/attempt_0/1/stderr.log")
    assert "Traceback" not in text(), text()[-3000:]
    # nothing of rank 0, which torchrun stopped after it (SIGTERM), nor of torchrun's stop
    assert failure_lines(text(), "killed by SIGKILL") == [last_line(text())], text()[-3000:]


def test_a_second_launch_of_a_running_run_waits_then_exits_6(tmp_path):
    args = [str(ROOT / "configs" / "quickstart.yaml"), *SMALL, "train.max_steps=100000",
            f"output.dir={tmp_path / 'runs'}"]
    log = (tmp_path / "out.log").open("w")
    first = subprocess.Popen([sys.executable, ENTRY, "train", *args], cwd=tmp_path,
                             env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "step 2/" in (tmp_path / "out.log").read_text(), 180, "no training")
        second = entry("train", *args, "seed=2", "run.lock_wait_s=2", cwd=tmp_path, timeout=240)
        assert second.returncode == 6
        assert "is in use by job launch-" in last_line(second.stderr)
        assert "still after 2 s (run.lock_wait_s)" in last_line(second.stderr)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=limit(60)) == 143
    finally:
        if first.poll() is None:
            first.kill()
    config = (tmp_path / "runs" / "quickstart" / "config.yaml").read_text()
    assert "seed: 0" in config  # the second launch wrote nothing


@pytest.mark.parametrize("nproc", [2])  # 1: tests/unit/test_safety.py
def test_sigterm_to_the_launchers_process_group_checkpoints_with_loader_workers(tmp_path,
                                                                                nproc):
    """kill -TERM -- -PGID of `entrypoint.py train` with data-loading workers; with two
    processes torchrun passes it on to each rank's whole group, loader workers included."""
    sigterm_to_the_launchers_group(tmp_path, nproc)
