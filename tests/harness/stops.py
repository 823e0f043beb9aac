"""A run stopped by a signal to its whole process group, as systemd, SLURM's scancel,
`timeout` or a terminal's Ctrl-C send it: the signal, the wait for every process of the
group to be gone, and what one clean stop looks like in the output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.harness.procs import alive, descendants, group
from tests.harness.runs import ENTRY, ROOT, SMALL, clean_env, last_line, limit, wait_for
from train.checkpoint import Checkpointer


def signal_the_group(proc: subprocess.Popen, sig: int, out: Path, err: Path,
                     at: str = "step 3/") -> set[int]:
    """As systemd, SLURM's scancel, `timeout` or a terminal's Ctrl-C do: ``sig`` to every
    process of the run's group (it was started with start_new_session) once training runs;
    wait for the end and for every process below it to be gone. Returns those processes."""
    text = lambda: out.read_text() + err.read_text()  # noqa: E731
    below: set[int] = set()
    try:
        wait_for(lambda: at in text(), 180, "no training")
        below = descendants(proc.pid)
        os.killpg(proc.pid, sig)
        proc.wait(timeout=limit(90))
        wait_for(lambda: not group(proc.pid) and not any(alive(p) for p in below), 10,
                 f"processes left behind: {sorted(group(proc.pid))} "
                 f"{sorted(p for p in below if alive(p))}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in [p for p in below if alive(p)]:
            os.kill(pid, signal.SIGKILL)
    return below


def assert_one_clean_stop(err: str, sig: int, ranks: int = 1) -> int:
    """One "received SIG..." line per rank (none from data-loading workers), no worker
    killed, no traceback; returns the step every rank stopped at."""
    name = signal.Signals(sig).name
    assert "killed by signal" not in err and "Traceback" not in err, err[-3000:]
    assert err.count(f"received {name}") == ranks, err[-3000:]
    for rank in range(ranks):
        assert err.count(f"[rank {rank}] WARNING received {name}") == 1, err[-3000:]
    stops = {int(line.split("stopped at step ")[1].split()[0]) for line in err.splitlines()
             if "stopped at step " in line}
    assert len(stops) == 1, err[-3000:]
    return stops.pop()


def sigterm_to_the_launchers_group(tmp_path: Path, nproc: int) -> None:
    """kill -TERM -- -PGID of `entrypoint.py train` with data-loading workers on ``nproc``
    processes, and what must follow (tests/unit/test_safety.py runs one process,
    tests/e2e/test_safety_runs.py two)."""
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    with out.open("w") as o, err.open("w") as e:
        launcher = subprocess.Popen(
            [sys.executable, ENTRY, "train", str(ROOT / "configs" / "quickstart.yaml"), *SMALL,
             "data.num_workers=2", f"distributed.nproc_per_node={nproc}",
             "train.max_steps=100000", f"output.dir={tmp_path / 'runs'}"],
            cwd=tmp_path, env=clean_env(), stdout=o, stderr=e, start_new_session=True)
    below = signal_the_group(launcher, signal.SIGTERM, out, err)
    # the worker(s), 2 loader workers each, and torchrun for two
    assert len(below) >= 3 * nproc + (nproc > 1), sorted(below)
    text = out.read_text() + err.read_text()
    assert launcher.returncode == 143, text[-3000:]
    step = assert_one_clean_stop(text, signal.SIGTERM, ranks=nproc)
    assert last_line(err.read_text()).startswith("stopped by SIGTERM; rerun")
    # torchrun's own account of the stop is said once, by launcher.torchrun
    assert "death signal" not in text and "closing signal" not in text, text[-3000:]
    found = Checkpointer(tmp_path / "runs" / "quickstart", rank=0,
                         keep_last=3).newest_loadable(rank=0)
    assert found is not None and found[0].name == f"step-{step}"
    assert (found[0] / f"rank-{nproc - 1}.pt").exists()
