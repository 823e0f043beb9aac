"""CPU threads and how they wait, as the workers really get them: the launcher's plan run
inside a real cgroup with a CPU quota, and the OpenMP library's own report of its
settings (``OMP_DISPLAY_ENV=verbose``: GNU OpenMP prints them when torch loads it).

The defaults' reasons are in train/core/machine/threads.py; their cost is bench/oversubscribe.py's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.harness import cgroups
from tests.harness.runs import ENTRY, ROOT, TINY_GPT, clean_env, limit, merge, write_config
from train.core.machine import threads
from train.core.machine.host import available_cpus

# GNU OpenMP's report (OMP_DISPLAY_ENV=verbose), one line per setting
SPIN = re.compile(r"GOMP_SPINCOUNT = '(\d+)'")
THREADS = re.compile(r"\| (\d+) CPU thread\(s\)")  # the worker's "model ..." line


def _env(**extra: str) -> dict:
    env = {k: v for k, v in clean_env().items() if not k.startswith(("OMP_", "GOMP_"))}
    return {**env, "OMP_DISPLAY_ENV": "verbose", **extra}


@pytest.fixture
def one_cpu_quota():
    """A cgroup holding its processes to 1 CPU, on a machine that has more; removed after."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs in the affinity mask to see a 1-CPU quota lower the count")
    why = cgroups.available()
    if why:
        pytest.skip(f"a CPU quota needs root and a writable cgroup cpu controller: {why}")
    limit_ = cgroups.CpuLimit(1.0)
    yield limit_
    limit_.close()


def test_a_cgroup_quota_sizes_the_plan_and_the_workers_threads(tmp_path, one_cpu_quota):
    """A container or CI job limited to 1 CPU on a larger machine: one thread, not one per
    core of the host, in the plan (--dry-run) and in the worker that trains."""
    config = write_config(tmp_path / "t.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path / "runs")}, "train": {"max_steps": 1}}))

    def inside(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, ENTRY, "train", str(config), *args],
                              cwd=tmp_path, env=_env(), capture_output=True, text=True,
                              timeout=limit(240),
                              preexec_fn=lambda: one_cpu_quota.add(os.getpid()))

    plan = inside("--dry-run")
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "OMP_NUM_THREADS=1 " in plan.stdout and "OMP_WAIT_POLICY=PASSIVE " in plan.stdout
    run = inside()
    assert run.returncode == 0, run.stderr[-3000:]
    assert THREADS.findall(run.stderr) == ["1"]
    assert SPIN.findall(run.stderr) == ["0"]  # PASSIVE: a waiting thread sleeps at once


def test_outside_a_quota_the_plan_takes_the_affinity_mask(tmp_path):
    """The same command outside any quota: the CPUs this process may run on (the mask
    ``taskset`` or a cpuset gives), as train/core/machine/host.py reads them."""
    config = write_config(tmp_path / "t.yaml", TINY_GPT)
    one = {str(sorted(os.sched_getaffinity(0))[0])}
    plan = subprocess.run(["taskset", "-c", ",".join(one), sys.executable, ENTRY, "train",
                           str(config), "--dry-run"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=limit(120))
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "OMP_NUM_THREADS=1 " in plan.stdout


@pytest.mark.parametrize("given,spin,count", [
    ({}, "0", None),
    ({"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "3"}, "30000000000", "3")])
def test_a_bare_worker_applies_the_defaults_and_the_users_variables_win(tmp_path, given,
                                                                        spin, count):
    """``python -m train`` without the launcher: the same wait policy, set before torch
    loads (libgomp reads it only then), and its share of the CPUs; the user's own
    OMP_WAIT_POLICY and OMP_NUM_THREADS win over both."""
    config = write_config(tmp_path / "t.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path / "runs")}, "train": {"max_steps": 1}}))
    run = subprocess.run([sys.executable, "-m", "train", str(config)], cwd=ROOT,
                         env=_env(PYTHONPATH=str(ROOT), **given), capture_output=True,
                         text=True, timeout=limit(240))
    assert run.returncode == 0, run.stderr[-3000:]
    assert SPIN.findall(run.stderr) == [spin]
    assert THREADS.findall(run.stderr) == [count or str(available_cpus())]


def test_thread_defaults_leave_the_wait_to_a_users_spin_count():
    assert threads.thread_defaults(8, 3, {}) == {"OMP_NUM_THREADS": "2",
                                                 "OMP_WAIT_POLICY": "PASSIVE"}
    assert threads.thread_defaults(1, 4, {"GOMP_SPINCOUNT": "0"}) == {"OMP_NUM_THREADS": "1"}
    env = {"OMP_WAIT_POLICY": "active"}
    assert threads.apply_before_torch(env) == {} and env == {"OMP_WAIT_POLICY": "active"}
