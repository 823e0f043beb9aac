"""Nothing lost, with real runs: restarts within one launch train the config the launch
validated, however the file changes, and a rerun with an edited config says which keys
changed; a full disk or a checkpoint folder turned read-only mid-run: one line, the
partial checkpoint removed, no futile restart (exit 3).

Real processes and real files; the disk is a real tmpfs mounted in a mount namespace of
the test's own (skipped where the machine gives no rights for one). Links and a damaged
config.yaml: tests/unit/test_run_files.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.procs import children, cmdline
from tests.harness.runs import (
    ENTRY,
    TINY_GPT,
    clean_env,
    entry,
    failure_lines,
    limit,
    merge,
    tiny_run_config,
    write_config,
)
from train.core.run import rundir

# ------------------------------------------------------------------ the config read again

def worker_pids(launcher_pid: int) -> list[int]:
    return [p for p in children(launcher_pid) if "train.worker" in cmdline(p)]


def test_a_restart_trains_the_config_its_launch_validated(tmp_path):
    """The config file edited mid-run, then the worker killed: the launcher's restart
    trains the run that started (its max_steps, its evaluation); a later rerun of the
    edited file resumes and names each changed key."""
    config = tiny_run_config(tmp_path, max_steps=30, eval_every_steps=10)
    log = (tmp_path / "out.log").open("w")
    launcher = subprocess.Popen([sys.executable, ENTRY, "train", str(config),
                                 "distributed.max_restarts=1", "logging.every_steps=1"],
                                cwd=tmp_path, env=clean_env(), stdout=log,
                                stderr=subprocess.STDOUT)
    text = lambda: (tmp_path / "out.log").read_text()  # noqa: E731
    try:
        deadline = time.monotonic() + limit(180)
        while "checkpoint saved" not in text() and time.monotonic() < deadline:
            time.sleep(0.2)
        edited = json.loads(json.dumps(merge(TINY_GPT, {
            "output": {"dir": str(tmp_path / "runs")}, "checkpoint": {"every_steps": 2},
            "train": {"max_steps": 40, "eval_every_steps": 3}})))
        write_config(config, edited)
        for pid in worker_pids(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        assert launcher.wait(timeout=limit(240)) == 0, text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert "entrypoint: rank 0 killed by SIGKILL" in text() and \
        "restarting the worker (1 of 1)" in text()
    run_dir = tmp_path / "runs" / "run"
    assert json.loads((run_dir / "result.json").read_text())["step"] == 30
    evals = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text()
                                    .splitlines()) if "val/loss" in r]
    assert evals == [10, 20, 30]
    rerun = entry("train", str(config), cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    (warning,) = [ln for ln in rerun.stderr.splitlines() if "resuming" in ln]
    assert f"warning: {config}: resuming {run_dir} with a config that differs from the one " \
           f"it ran with ({run_dir / 'config.yaml'}): " in warning
    assert "train.max_steps 30 -> 40" in warning and "train.eval_every_steps 10 -> 3" in warning


# ------------------------------------------------------------------ the disk

def in_mount_namespace(script: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``script`` (bash) in a mount namespace of its own: mounts made there vanish with it."""
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip("no rights for a mount namespace (unshare --mount): "
                    f"{probe.stderr.decode().strip()}")
    return subprocess.run(["unshare", "--mount", "bash", "-c", script], env=clean_env(),
                          capture_output=True, text=True, timeout=limit(timeout))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # fsdp: each rank writes its shards
def test_a_full_disk_is_one_line_and_no_futile_restart(tmp_path, strategy):
    """2 processes under torchrun (which restarts workers whatever their exit code): the
    checkpoint cannot be written on a 128 KiB disk; one line names the free space, the
    partial checkpoint is gone, torchrun does not restart them, exit 3."""
    config = tiny_run_config(tmp_path, max_steps=4)
    checkpoints = tmp_path / "runs" / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    out = in_mount_namespace(
        f"mount -t tmpfs -o size=128k tmpfs {checkpoints} || exit 99\n"
        f"cd {tmp_path}; {sys.executable} {ENTRY} train {config} distributed.nproc_per_node=2 "
        f"distributed.max_restarts=2 distributed.strategy={strategy}; rc=$?\n"
        f"echo LEFT: $(ls -A {checkpoints}); exit $rc")
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot write checkpoint step-2.partial/") and \
        f"no space left on {checkpoints}" in last and "MiB free" in last, last
    assert "LEFT:" in out.stdout.splitlines(), out.stdout  # nothing left on the full disk
    assert "Traceback" not in out.stderr
    assert "restarting the workers" not in out.stderr, out.stderr[-3000:]  # not restarted
    # every rank met it: said once, by the launcher
    assert failure_lines(out.stdout + out.stderr, "cannot write checkpoint") == [last], \
        out.stderr[-3000:]


def test_a_checkpoint_folder_turned_read_only_is_one_line(tmp_path):
    """The folder turns read-only between two saves (or while one has begun: a partial the
    read-only disk will not let go of may stay). One line, exit 3; once writable again,
    the run resumes from the newest sealed checkpoint and the partial goes."""
    config = tiny_run_config(tmp_path, max_steps=200)
    checkpoints = tmp_path / "runs" / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    log, resumed = tmp_path / "out.log", tmp_path / "resumed.log"
    out = in_mount_namespace(
        f"mount -t tmpfs -o size=64m tmpfs {checkpoints} || exit 99\n"
        f"cd {tmp_path}; {sys.executable} {ENTRY} train {config} logging.every_steps=1 "
        f">{log} 2>&1 & pid=$!\n"
        f"until grep -q 'checkpoint saved' {log}; do sleep 0.2; kill -0 $pid || exit 98; done\n"
        f"until mount -o remount,ro {checkpoints}; do sleep 0.05; done\n"  # no file open
        f"wait $pid; rc=$?; echo SEALED: $(cat {checkpoints}/latest)\n"
        f"mount -o remount,rw {checkpoints}; newest=$(cat {checkpoints}/latest)\n"
        f"{sys.executable} {ENTRY} train {config} train.max_steps=$((${{newest#step-}} + 1)) "
        f">{resumed} 2>&1 || exit 97\n"
        f"echo PARTIALS: $(ls -d {checkpoints}/*.partial 2>/dev/null); exit $rc", timeout=400)
    text = log.read_text()
    assert out.returncode == 3, out.stdout + text[-3000:] + resumed.read_text()[-2000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("error: cannot write checkpoint step-") and \
        "read-only file system" in last, last
    assert "Traceback" not in text
    sealed = out.stdout.split("SEALED: ")[1].split()[0]
    assert f"resumed from {checkpoints / sealed} at step {rundir.step_of(Path(sealed))}," in \
        resumed.read_text(), resumed.read_text()[-2000:]
    assert "PARTIALS:" in out.stdout.splitlines(), out.stdout
