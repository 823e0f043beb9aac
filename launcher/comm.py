"""``doctor --comm``: a small all-reduce across local processes, naming who did not answer.

The parent starts one process per GPU (or two on CPU) with torchrun's variables
set by hand, and each process records the stage it reached (start, init,
all-reduce, done) in a report file as it goes. When the deadline passes, the parent
stops them and names each rank by the stage it was stuck in — the usual NCCL hang
gives no hint of which rank is missing.

Each child runs :mod:`train.comm_probe` (it imports torch; this module does not).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

from train.core import protocol
from train.core.identity import STATUS_DIR_VAR


def run(device: str, backend: str, nproc: int, timeout_s: float, base_env: Mapping[str, str],
        extra_env: Mapping[str, str], port: int) -> dict:
    """Parent side: start nproc children, wait up to timeout_s (+ start-up), summarise."""
    folder = tempfile.mkdtemp(prefix="train-comm-")
    procs = []
    for rank in range(nproc):
        env = {**base_env, **extra_env, STATUS_DIR_VAR: folder, "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "train.comm_probe", "--device", device, "--backend", backend,
             "--timeout", str(timeout_s)], env=env, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout_s + 30  # + interpreter and torch start-up
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    timed_out = [i for i, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    outputs = [p.communicate()[0] for p in procs]
    try:
        return summarise(folder, nproc, timed_out, outputs, device, backend, timeout_s)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def summarise(folder: str, nproc: int, timed_out: list[int], outputs: list[str], device: str,
              backend: str, timeout_s: float) -> dict:
    found = {r.rank: r for r in protocol.read_all(folder, kind=protocol.COMM)}
    ranks = []
    for rank in range(nproc):
        r = found.get(rank)
        rep = {"rank": rank, "stage": r.stage if r else "not started",
               **({"error": r.error} if r and r.error else {}), **_measured(r),
               "timed_out": rank in timed_out}
        if rep["stage"] != "done" and outputs[rank].strip():
            rep["output_tail"] = outputs[rank].strip().splitlines()[-3:]
        ranks.append(rep)
    bad = [r for r in ranks if r["stage"] != "done" or not r.get("ok")]
    problems = []
    for r in bad:
        if r["stage"] == "error":
            problems.append(f"rank {r['rank']} failed: {r.get('error')}")
        elif r["stage"] == "done":
            problems.append(f"rank {r['rank']} got a wrong all-reduce result")
        else:
            problems.append(f"rank {r['rank']} did not answer within {timeout_s:.0f} s (stuck "
                            f"at stage '{r['stage']}')")
    done = [r for r in ranks if r["stage"] == "done"]
    return {"ok": not bad, "device": device, "backend": backend, "processes": nproc,
            "seconds": max((r.get("seconds") or 0 for r in done), default=None),
            "bus_gb_s": min((r["bus_gb_s"] for r in done if r.get("bus_gb_s")), default=None),
            "problems": problems, "ranks": ranks}


def _measured(r: protocol.Report | None) -> dict:
    """The probe's measurements, as the report's JSON shows them."""
    if r is None or r.probe is None:
        return {}
    return {k: v for k, v in dataclasses.asdict(r.probe).items() if v is not None}
