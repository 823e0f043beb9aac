"""A slow rank is named, all ranks slow together is not: two processes under the
launcher, one of them held to a share of a CPU by a cgroup quota the test creates and
removes (tests/harness/cgroups.py) once training runs; or the whole machine made busy.

Bounds are generous limits against hangs on a loaded machine, not measurements."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import cgroups
from tests.harness.procs import worker_of_rank
from tests.harness.runs import ENTRY, TINY_MLP, clean_env, limit, merge, write_config

NAMED = re.compile(r"straggler: rank (\d+) \(([^)]+)\) is slow in (data|compute): ([\d.]+)x")


@pytest.fixture
def limits():
    why = cgroups.available()
    if why:
        pytest.skip(f"CPU quotas need root and a cgroup cpu controller: {why}")
    made: list[cgroups.CpuLimit] = []
    yield lambda cpus: made.append(cgroups.CpuLimit(cpus)) or made[-1]
    for m in made:
        m.close()


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A job of two ranks with a few milliseconds of compute a step, logging every 5
    steps, stragglers judged over 30 steps (and 10 s at least)."""
    config = write_config(tmp_path / "c.yaml", merge(TINY_MLP, {
        "output": {"dir": str(tmp_path / "runs")},
        "model": {"depth": 3, "width": 384},
        "data": {"shape": [256], "num_samples": 4096},
        "train": {"max_steps": 100000, "global_batch_size": 64, "eval_every_steps": 0},
        "checkpoint": {"every_steps": 0},
        "logging": {"every_steps": 5, "progress": "plain", "straggler_steps": 30},
        "distributed": {"nproc_per_node": 2, "grace_period_s": 30}}))
    log = tmp_path / "out.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, ENTRY, "train", str(config)], cwd=tmp_path,
                                env=clean_env(OMP_NUM_THREADS="1"), stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    return proc, log


def _wait_for(proc: subprocess.Popen, log: Path, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + limit(timeout)
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if re.search(pattern, text):
            return text
        assert proc.poll() is None, text[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout} s:\n{log.read_text()[-3000:]}")


def _step(text: str) -> int:
    steps = re.findall(r"step (\d+)/", text)
    return int(steps[-1]) if steps else 0


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()  # a stop signal: the ranks agree, checkpoint, exit 143
    try:
        proc.wait(timeout=limit(120))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _events(tmp_path: Path) -> list[dict]:
    rows = [json.loads(line) for path in (tmp_path / "runs").glob("*/metrics.jsonl")
            for line in path.read_text().splitlines()]
    return rows


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of the process onto ``cpus`` (affinity is a thread's own)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except OSError:  # the thread ended meanwhile
            pass


def test_a_rank_held_to_a_tenth_of_a_cpu_is_named_then_keeps_pace_again(tmp_path, limits):
    """Both ranks share one CPU, so that the machine's other load (a busy CI host) falls
    on them alike: spread over several CPUs, the scheduler's placement can make rank 0
    slower than rank 1 for real, and the judge would rightly name it."""
    proc, log = _start(tmp_path)
    try:
        _wait_for(proc, log, r"step 10/", 240)
        cpu = {min(os.sched_getaffinity(0))}
        for rank in ("0", "1"):
            _pin(worker_of_rank(proc.pid, rank), cpu)
        slow = limits(0.1)
        slow.add(worker_of_rank(proc.pid, "1"))
        held_at, held = _step(log.read_text()), time.monotonic()
        text = _wait_for(proc, log, r"straggler: rank \d", 240)
        print(f"the slow rank named {time.monotonic() - held:.1f} s after it was held")
        named = NAMED.search(text)
        assert named and named[1] == "1", text[-3000:]
        assert float(named[4]) >= 1.3
        slow.release()
        _wait_for(proc, log, r"straggler: rank 1 \([^)]+\) keeps pace again", 240)
    finally:
        _stop(proc)
    text = log.read_text()
    assert "straggler: rank 0" not in text, text[-3000:]
    events = [e for e in _events(tmp_path) if e.get("event", "").startswith("straggler")]
    assert [(e["event"], e["rank"]) for e in events] == [("straggler", 1),
                                                          ("straggler_over", 1)], events
    assert events[0]["phase"] in ("data", "compute") and events[0]["step"] >= held_at + 15
    ratios = [e["ranks/slowest_ratio"] for e in _events(tmp_path) if "ranks/slowest_ratio" in e]
    assert max(ratios) >= 1.3, ratios


def test_a_busy_cpu_slowing_every_rank_alike_names_no_one(tmp_path):
    """The control: the same job, both ranks on one CPU shared with four processes that
    spin on it, for longer than the slow rank above takes to be named (25 s):
    every rank is slower, alike (one run queue shares the CPU fairly), none is named.
    (Spread over several CPUs, the scheduler's placement makes a rank slower than its
    peer for real: that would be a straggler.)"""
    proc, log = _start(tmp_path)
    cpu = {min(os.sched_getaffinity(0))}
    spinners = []
    try:
        _wait_for(proc, log, r"step 10/", 240)
        for rank in ("0", "1"):
            _pin(worker_of_rank(proc.pid, rank), cpu)
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(4)]
        for spinner in spinners:
            _pin(spinner.pid, cpu)
        held_at = _step(log.read_text())
        time.sleep(25)  # two and a half windows of judgement (10 s each, at least)
        _wait_for(proc, log, rf"step {held_at + 90 - held_at % 5}/", 300)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        _stop(proc)
    text = log.read_text()
    assert "straggler:" not in text, [line for line in text.splitlines() if "straggler" in line]
    ratios = [e["ranks/slowest_ratio"] for e in _events(tmp_path) if "ranks/slowest_ratio" in e]
    assert len(ratios) >= 18 and max(ratios) < 1.3, ratios  # judged, and no rank apart
