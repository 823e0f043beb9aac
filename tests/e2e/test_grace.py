"""A stop checkpoint gets the platform's whole grace period, not torchrun's 30 s.

torchrun forwards SIGTERM to its workers and SIGKILLs them after its shutdown timeout;
the launcher sets that from ``distributed.grace_period_s`` (Kubernetes'
terminationGracePeriodSeconds, SLURM's KillWait). Here a checkpoint write is made to
take 40 s (a slow shared file system), in 2 real processes under torchrun.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.harness.runs import (
    ROOT,
    TINY_GPT,
    clean_env,
    limit,
    merge,
    slow_state_writes,
    write_config,
)

# Every process imports this first (PYTHONPATH): the rank-0 state file of a checkpoint
# takes 40 s more to write.


def test_a_40_s_stop_checkpoint_survives_sigterm_under_torchrun(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(slow_state_writes(40))
    config = write_config(tmp_path / "run.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path / "runs")}, "train": {"max_steps": 100000},
        "checkpoint": {"every_steps": 0}, "distributed": {"grace_period_s": 90}}))
    log = (tmp_path / "out.log").open("w")
    launcher = subprocess.Popen(
        [sys.executable, str(ROOT / "entrypoint.py"), "train", str(config),
         "distributed.nproc_per_node=2"], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
        env=clean_env(PYTHONPATH=f"{tmp_path / 'site'}:{ROOT}"))
    text = lambda: (tmp_path / "out.log").read_text()  # noqa: E731
    try:
        deadline = time.monotonic() + limit(180)
        while "step 3/" not in text() and time.monotonic() < deadline:
            time.sleep(0.2)
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=limit(150)) == 143, text()[-3000:]
        took = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert took > 40, f"the stop took {took:.0f} s: was the save cut short?"
    latest = (tmp_path / "runs" / "run" / "checkpoints" / "latest").read_text().strip()
    assert (tmp_path / "runs" / "run" / "checkpoints" / latest / "checksums.json").is_file()
