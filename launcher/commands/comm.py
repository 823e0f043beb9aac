"""``doctor --comm``: the preflight check across local processes, naming who did not answer.

The parent starts one process per GPU (or two on CPU) with torchrun's variables
set by hand, and each process records the stage it reached (start, init, matmul,
all-reduce, done) in a report file as it goes. When the deadline passes, the parent
stops them and names each rank by the stage it was stuck in — the usual NCCL hang
gives no hint of which rank is missing. The ranks that finished are judged as training
judges them before step 1 (:func:`train.core.nodes.verdict.judge`): the same lines.

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

from train.core.config import DistributedConfig
from train.core.nodes import verdict as preflight
from train.core.run import protocol
from train.core.run.identity import STATUS_DIR_VAR

SLOW_RATIO = DistributedConfig().preflight_slow_ratio  # distributed.preflight_slow_ratio


def run(device: str, backend: str, nproc: int, timeout_s: float, base_env: Mapping[str, str],
        extra_env: Mapping[str, str], port: int, slow_ratio: float = SLOW_RATIO) -> dict:
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
        return summarise(folder, nproc, timed_out, outputs, device, backend, timeout_s,
                         slow_ratio)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def summarise(folder: str, nproc: int, timed_out: list[int], outputs: list[str], device: str,
              backend: str, timeout_s: float, slow_ratio: float = SLOW_RATIO) -> dict:
    """The result as doctor shows it: ``problems`` (a rank that failed, did not answer,
    or whose matmul or all-reduce went wrong: not ok), ``slow`` (ranks far below the
    median) and ``preflight`` (the lines training would print)."""
    found = {r.rank: r for r in protocol.read_all(folder, kind=protocol.COMM)}
    ranks = [_rank(rank, found.get(rank), rank in timed_out, outputs[rank])
             for rank in range(nproc)]
    problems = [p for r in ranks if (p := _problem(r, timeout_s))]
    done = [r for r in ranks if r["stage"] == "done"]
    verdict = preflight.judge([_result(found[r["rank"]]) for r in done], slow_ratio) \
        if done else preflight.Verdict()
    problems += verdict.failures
    return {"ok": not problems, "device": device, "backend": backend, "processes": nproc,
            "seconds": max((r.get("seconds") or 0 for r in done), default=None),
            "bus_gb_s": min((r["bus_gb_s"] for r in done if r.get("bus_gb_s")), default=None),
            "problems": problems, "slow": verdict.slow,
            "preflight": verdict.lines if len(done) == nproc else [], "ranks": ranks}


def _rank(rank: int, r: protocol.Report | None, timed_out: bool, output: str) -> dict:
    rep = {"rank": rank, "stage": r.stage if r else "not started",
           **({"error": r.error} if r and r.error else {}), **_measured(r),
           "timed_out": timed_out}
    if rep["stage"] != "done" and output.strip():
        rep["output_tail"] = output.strip().splitlines()[-3:]
    return rep


def _problem(r: dict, timeout_s: float) -> str | None:
    """A rank that failed or did not answer; what a finished one measured is judged."""
    if r["stage"] == "error":
        return f"rank {r['rank']} failed: {r.get('error')}"
    if r["stage"] != "done":
        return (f"rank {r['rank']} did not answer within {timeout_s:.0f} s (stuck at stage "
                f"'{r['stage']}')")
    return None


def _result(r: protocol.Report) -> preflight.RankResult:
    """A probe's report as the preflight rule reads a rank's measurements."""
    p = r.probe or protocol.Probe()
    return preflight.RankResult(
        rank=r.rank, node=p.node or 0, host=p.host or "?", local_rank=r.local_rank,
        gflops=p.gflops, nonfinite=p.nonfinite,
        allreduce_ms=None if p.seconds is None else p.seconds * 1000,
        allreduce_bytes=p.bytes or 0, allreduce_ok=p.ok is not False, seconds=p.check_s or 0.0)


def _measured(r: protocol.Report | None) -> dict:
    """The probe's measurements, as the report's JSON shows them."""
    if r is None or r.probe is None:
        return {}
    return {k: v for k, v in dataclasses.asdict(r.probe).items() if v is not None}
