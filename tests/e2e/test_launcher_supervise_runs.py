"""The supervisor with two stand-in workers under real torchrun (tests/harness/supervision.py):
a failing rank named, SIGTERM forwarded to the workers and 143. The exit-code mapping and
one process: tests/unit/test_launcher_supervise.py."""

from __future__ import annotations

import signal

from tests.harness.runs import limit
from tests.harness.supervision import start, wait_ready

# -------------------------------------------------------------------- real processes

def test_torchrun_worker_failure_is_1_naming_rank_1(tmp_path):
    proc = start("fail-rank-1", 2, tmp_path)
    _, err = proc.communicate(timeout=limit(120))
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last == ("error: training failed: rank 1: RuntimeError: boom on rank 1; details in "
                    "its output above")


def test_sigterm_reaches_torchrun_workers_and_exits_143(tmp_path):
    proc = start("sigterm", 2, tmp_path)
    wait_ready(tmp_path, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=limit(60))
    assert proc.returncode == 143, err
    # Both workers saw SIGTERM and reported 143 (torchrun's SIGKILL would leave no report).
    assert err.strip().splitlines()[-1] == ("stopped by SIGTERM; rerun the same command to "
                                            "resume from the last checkpoint")
