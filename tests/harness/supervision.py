"""The launcher's supervision with stand-in workers: a plan run by the real supervisor
whose workers are tests/fakes/fake_worker.py (they fail on one rank, crash, succeed, or
wait for SIGTERM and exit 143), alone or under real torchrun; no training, so a few
seconds each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.harness.runs import FAKES, ROOT, limit

FAKE = str(FAKES / "fake_worker.py")
RUN_PLAN = str(FAKES / "run_plan.py")


def start(mode: str, nproc: int, tmp_path: Path, restarts: int = 0) -> subprocess.Popen:
    """The launcher's supervisor (tests/fakes/run_plan.py) running a plan of ``nproc``
    stand-in workers (tests/fakes/fake_worker.py in ``mode``): alone for one, under real
    torchrun for more; stdout and stderr piped."""
    if nproc == 1:
        argv, plan_mode = [sys.executable, FAKE, mode], "direct"
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(nproc), "--max-restarts", "0", FAKE, mode]
        plan_mode = "torchrun"
    plan = {"mode": plan_mode, "argv": argv, "env": {"OMP_NUM_THREADS": "1"}, "device": "cpu",
            "backend": "gloo", "nproc_per_node": nproc, "nnodes": [1, 1],
            "world_sizes": [nproc], "max_restarts": restarts, "convention": "single"}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FAKE_READY_DIR": str(tmp_path)}
    return subprocess.Popen([sys.executable, RUN_PLAN, json.dumps(plan)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(tmp_path: Path, n: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until ``n`` stand-in workers said they are ready (their files in ``tmp_path``)."""
    deadline = time.monotonic() + limit(timeout)
    while len(list(tmp_path.glob("ready-*"))) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "workers never became ready"
        time.sleep(0.05)
