"""The multi-node preflight check: slow and bad nodes named before step 1.

A node with a throttled or faulty GPU (or a CPU starved by a neighbour) makes every
step of the job as slow as itself, or poisons it with NaN, and nothing says which node
it is. So, when a run spans more than one node (``distributed.preflight``: warn, the
default, or fail), every rank measures after the process group is up and before step 1:

- a matmul of a fixed size on its device (:data:`MATMUL`), a warm-up and
  :data:`REPEATS` timed repetitions: the median repetition's GFLOP/s, and whether any
  result held a NaN or inf;
- an all-reduce of a fixed size (:data:`ALLREDUCE`, float32) with every peer, the same
  repetitions: the median time, and whether every sum came out as the world size;
- its node's links: with every rank's node known, the nodes pair up in a few rounds and
  exchange a fixed-size tensor both ways (:mod:`train.guards.links`), so that a node
  whose every link is slow (a bad NIC, a congested port) is named, which the all-reduce,
  waiting alike on every rank for the slowest link, cannot do.

An all-gather brings every rank's :class:`~train.core.nodes.verdict.RankResult` to every
rank (once for the layout, once more with the links); each judges them alike
(:func:`train.core.nodes.verdict.judge`), so every rank reaches the same verdict without
another collective. Rank 0 logs a line per problem (or one
summary line) and appends the measurements to ``preflight.json`` in the run directory.
With ``fail``, a problem ends the run on every rank with exit 3 (this machine cannot run
the job: a restart on the same nodes would measure the same), the line naming the node.

A few seconds on CPUs and GPUs alike. It is bounded by the hang watchdog: each
repetition is a part of the ``preflight`` phase (:mod:`train.guards.watchdog`), so a rank
stuck in its matmul, the all-reduce or an exchange is named within its allowance, never left
to ``distributed.timeout_s``. ``doctor --comm`` runs :func:`measure` in its probes
(:mod:`train.comm_probe`), so both measure alike (its processes share one node: no
links to time).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist

from train.core.config import Config
from train.core.errors import UnfitNodes
from train.core.files import write_json_atomic
from train.core.nodes.verdict import FAIL, OFF, RankResult, Verdict, judge
from train.core.run import rundir
from train.core.run.identity import WorkerIdentity
from train.distributed import ranks
from train.guards import links
from train.guards.watchdog import PREFLIGHT, Watchdog

log = logging.getLogger("train")

# The matmul's side and dtype, by device type: 2.1 GFLOP per repetition on a CPU, 1.1
# TFLOP on a GPU ("cuda" is ROCm too). The operands are the same on every rank.
MATMUL = {"cpu": (1024, torch.float32), "cuda": (8192, torch.bfloat16)}
# float32 elements all-reduced: 1 MiB on CPUs (gloo), 64 MiB on GPUs.
ALLREDUCE = {"cpu": 256 * 1024, "cuda": 16 * 1024 * 1024}
WARMUP, REPEATS = 1, 5
KEEP = 20  # checks kept in preflight.json, the newest last

FIX = ("leave the node out and start the job again (Kubernetes: kubectl cordon NODE; "
       "SLURM: a job submitted with --requeue is requeued without it, else sbatch "
       "--exclude=HOST), or set distributed.preflight=warn to train on it")


def wanted(cfg: Config, env: WorkerIdentity) -> bool:
    """On a multi-node start, unless distributed.preflight is off."""
    return cfg.distributed.preflight != OFF and env.distributed and env.nodes > 1


def check_before_training(cfg: Config, env: WorkerIdentity, device: torch.device,
                          run_dir: Path, watchdog: Watchdog) -> Verdict | None:
    """The check, when :func:`wanted`, watched by the hang watchdog. Collective."""
    if not wanted(cfg, env):
        return None
    try:
        with watchdog.watching(PREFLIGHT, 0):
            return check(cfg, env, device, run_dir, watchdog.progress)
    finally:
        watchdog.pause()


def check(cfg: Config, env: WorkerIdentity, device: torch.device, run_dir: Path,
          progress: Callable[[], None] = lambda: None) -> Verdict:
    """Measure, gather, judge; rank 0 says it and records it. With distributed.preflight
    fail, a problem raises :class:`CannotRunHere` on every rank."""
    started = time.perf_counter()
    mine = measure(env, device, progress)
    results = ranks.gather(env)(mine)
    mine = replace(mine, links=links.measure(results, mine, device, progress),
                   link_bytes=links.nbytes(device))
    mine = replace(mine, seconds=time.perf_counter() - started)
    results = ranks.gather(env)(mine)
    verdict = judge(results, cfg.distributed.preflight_slow_ratio)
    if env.is_main:
        for line in verdict.problems:
            log.warning("%s", line)
        if verdict.summary:
            log.info("%s", verdict.summary)
        record(run_dir, cfg, results, verdict)
    if verdict.problems and cfg.distributed.preflight == FAIL:
        raise UnfitNodes(f"{verdict.one_line()}; distributed.preflight=fail: nothing was "
                         f"trained; {FIX}", tuple(verdict.hosts))
    return verdict


def measure(env: WorkerIdentity, device: torch.device,
            progress: Callable[[], None] = lambda: None,
            stage: Callable[[str], None] = lambda name: None) -> RankResult:
    """This rank's part. An error in the matmul (the device's) is recorded for the
    verdict; the all-reduce is a collective and raises like any other."""
    started = time.perf_counter()
    gflops = nonfinite = error = None
    stage("matmul")
    try:
        gflops, nonfinite = _matmul(device, progress)
    except (RuntimeError, ArithmeticError) as exc:  # a faulty device (torch raises its
        # device errors as RuntimeError), or a clock too coarse: the verdict names the rank
        error = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    stage("allreduce")
    ms, nbytes, ok = _allreduce(device, env.world_size, progress)
    return RankResult(rank=env.rank, node=env.node, host=socket.gethostname(),
                      scheduler_node=os.environ.get("SLURMD_NODENAME"),
                      local_rank=env.local_rank, gflops=gflops, nonfinite=nonfinite,
                      allreduce_ms=ms, allreduce_bytes=nbytes, allreduce_ok=ok, error=error,
                      seconds=time.perf_counter() - started)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _matmul(device: torch.device, progress: Callable[[], None]) -> tuple[float, str | None]:
    """(the median repetition's GFLOP/s, "NaN" or "inf" if any result held one)."""
    n, dtype = MATMUL.get(device.type, MATMUL["cpu"])
    gen = torch.Generator(device=device).manual_seed(0)  # the run's own RNG is left alone
    a = torch.rand(n, n, generator=gen, device=device).to(dtype)
    b = torch.rand(n, n, generator=gen, device=device).to(dtype)
    times, bad = [], None
    for i in range(WARMUP + REPEATS):
        _sync(device)
        start = time.perf_counter()
        c = torch.mm(a, b)
        _sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
        bad = bad or _nonfinite(c)
        progress()
    return 2 * n ** 3 / statistics.median(times) / 1e9, bad


def _nonfinite(t: torch.Tensor) -> str | None:
    if bool(torch.isfinite(t).all()):
        return None
    return "NaN" if bool(torch.isnan(t).any()) else "inf"


def _allreduce(device: torch.device, world: int,
               progress: Callable[[], None]) -> tuple[float, int, bool]:
    """(the median repetition's milliseconds, bytes all-reduced, every sum right)."""
    x = torch.ones(ALLREDUCE.get(device.type, ALLREDUCE["cpu"]), device=device)
    times, ok = [], True
    for i in range(WARMUP + REPEATS):  # the warm-up connects the ring
        x.fill_(1.0)
        _sync(device)
        start = time.perf_counter()
        dist.all_reduce(x)
        _sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
        ok = ok and bool((x == world).all())
        progress()
    return statistics.median(times) * 1000, x.numel() * x.element_size(), ok


def record(run_dir: Path, cfg: Config, results: list[RankResult], verdict: Verdict) -> None:
    """Append this check to ``preflight.json`` (the last :data:`KEEP`)."""
    path = Path(run_dir) / rundir.PREFLIGHT
    try:
        checks = json.loads(path.read_text(encoding="utf-8"))["checks"]
        checks = checks if isinstance(checks, list) else []
    except (OSError, ValueError, KeyError, TypeError):
        checks = []
    checks.append({"time": datetime.now(UTC).isoformat(timespec="seconds"),
                   "mode": cfg.distributed.preflight,
                   "slow_ratio": cfg.distributed.preflight_slow_ratio,
                   "problems": verdict.problems, "summary": verdict.summary,
                   "ranks": [asdict(r) for r in sorted(results, key=lambda r: r.rank)]})
    write_json_atomic(path, {"checks": checks[-KEEP:]})
