"""The run directory's lease (train/core/run/runlock.py) taken over from a running launch: the
launch stops without writing more. Real processes and files; the lease's other rules:
tests/unit/test_run_lease.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.harness.runs import ROOT, TINY_GPT, clean_env, limit, merge, write_config
from train.core.errors import EXIT_RUN_DIR_BUSY


def test_a_launch_whose_lease_was_taken_over_stops_without_writing(tmp_path):
    """Another job's record appears in RUN_DIR/.lock (it took the lease over: this launch
    was cut off from the shared storage for run.lock_expiry_s): exit 6, one line, and
    no checkpoint written after that."""
    config = write_config(tmp_path / "run.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path / "runs")}, "train": {"max_steps": 100000},
        "checkpoint": {"every_steps": 5}, "run": {"lock_renew_s": 0.5, "lock_expiry_s": 2}}))
    log = (tmp_path / "out.log").open("w")
    launcher = subprocess.Popen([sys.executable, str(ROOT / "entrypoint.py"), "train",
                                 str(config)], cwd=tmp_path, env=clean_env(), stdout=log,
                                stderr=subprocess.STDOUT)
    text = lambda: (tmp_path / "out.log").read_text()  # noqa: E731
    lease = tmp_path / "runs" / "run" / ".lock"
    try:
        deadline = time.monotonic() + limit(180)
        while "checkpoint saved" not in text() and time.monotonic() < deadline:
            time.sleep(0.2)
        lease.write_text(json.dumps({"job": "job-intruder", "host": "elsewhere", "pid": 7,
                                     "renewed": time.time(), "renewals": 0, "nonce": "n"}))
        assert launcher.wait(timeout=limit(60)) == EXIT_RUN_DIR_BUSY, text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert text().strip().splitlines()[-1].startswith(
        f"error: the run directory {tmp_path / 'runs' / 'run'} was taken over by job "
        "job-intruder (pid 7 on elsewhere)")
    latest = (tmp_path / "runs" / "run" / "checkpoints" / "latest").read_text().strip()
    time.sleep(2)
    assert (tmp_path / "runs" / "run" / "checkpoints" / "latest").read_text().strip() == latest
    assert json.loads(lease.read_text())["job"] == "job-intruder"
