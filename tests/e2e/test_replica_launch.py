"""Replica groups launched for real (``distributed.fault_tolerance: replicas``): a script
under ``entrypoint.py launch`` in 2 groups and a spare, each group one torchrun, all
meeting torchft's real Lighthouse. A worker killed in one group is restarted by that
group's torchrun while the others keep their processes; a killed Lighthouse is one line
and everything starts again; SIGTERM stops every group (143). A pod of Kubernetes'
Indexed Job (k8s/kustomize/replicas: the Lighthouse is its Deployment's, started here
as that Deployment does) waits for a new Lighthouse at the same address after losing one,
and exits 1 after one loss more than ``distributed.max_restarts`` (the whole pods, with
training, in tests/e2e/test_k8s_replicas.py). The plan's side:
tests/unit/test_replica_plan.py.

Each worker writes ``worker-GROUP-PID.txt`` (its pid and variables) once the
Lighthouse's port answered, then waits for the test's ``go`` file and exits 0.
"""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launcher.detection.system import free_port
from launcher.detection.torchft_tools import lighthouse_binary
from tests.harness import procs
from tests.harness.runs import ENTRY, clean_env, limit, wait_for

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None or lighthouse_binary() is None,
    reason="needs torchft and its torchft_lighthouse (make ft)")

WORKER = textwrap.dedent("""
    import os, socket, time
    from pathlib import Path
    out = Path(os.environ["OUT_DIR"])
    lighthouse = os.environ["TORCHFT_LIGHTHOUSE"]
    host, port = lighthouse.removeprefix("http://").rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=10).close()  # it answers
    seen = [os.getpid(), os.environ["REPLICA_GROUP_ID"], os.environ["NUM_REPLICA_GROUPS"],
            lighthouse, os.environ["TRAIN_REPLICA_ADDR"]]
    name = f"worker-{seen[1]}-{seen[0]}.txt"
    (out / (name + ".tmp")).write_text(" ".join(map(str, seen)))
    os.replace(out / (name + ".tmp"), out / name)
    while not (out / "go").exists():
        time.sleep(0.2)
""")


def start(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """The launcher of 2 groups and a spare; (its process, the workers' folder, its
    stderr file)."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "work.py").write_text(WORKER)
    err = tmp_path / "launcher.err"
    proc = subprocess.Popen(
        [sys.executable, ENTRY, "launch", "distributed.fault_tolerance=replicas",
         "distributed.replicas=2", "distributed.spares=1", "distributed.max_restarts=3",
         "work.py"], cwd=tmp_path, env=clean_env(OUT_DIR=str(out)),
        stdout=subprocess.DEVNULL, stderr=err.open("w"))
    return proc, out, err


def pod(tmp_path: Path, port: int) -> tuple[subprocess.Popen, Path, Path]:
    """Index 0 of a Job of 2 replica groups + 1 spare, its Lighthouse at ``port``, at most
    one relaunch; (its launcher, the workers' folder, its stderr file)."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "work.py").write_text(WORKER)
    err = tmp_path / "pod.err"
    env = clean_env(OUT_DIR=str(out), JOB_COMPLETION_INDEX="0", TRAIN_NNODES="3",
                    TRAIN_RDZV_ID="job-uid", TRAIN_RDZV_ENDPOINT="127.0.0.1:29400",
                    TRAIN_LOCAL_ADDR="127.0.0.1",
                    TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}")
    proc = subprocess.Popen(
        [sys.executable, ENTRY, "launch", "distributed.fault_tolerance=replicas",
         "distributed.replicas=2", "distributed.spares=1", "distributed.max_restarts=1",
         "work.py"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
        stderr=err.open("w"))
    return proc, out, err


def deployment_lighthouse(tmp_path: Path, port: int) -> subprocess.Popen:
    """``entrypoint.py lighthouse``, as the Deployment runs it (here on 127.0.0.1)."""
    return subprocess.Popen([sys.executable, ENTRY, "lighthouse", "--host", "127.0.0.1",
                             "--port", str(port)], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def started(out: Path) -> dict[str, list[dict]]:
    """Group id -> each of its workers' starts, oldest first."""
    found: dict[str, list[dict]] = {}
    for path in sorted(out.glob("worker-*.txt"), key=lambda p: p.stat().st_mtime_ns):
        pid, group, groups, lighthouse, addr = path.read_text().split()
        found.setdefault(group, []).append({"pid": int(pid), "groups": groups,
                                            "lighthouse": lighthouse, "addr": addr})
    return found


def latest(out: Path) -> dict[str, int]:
    return {g: starts[-1]["pid"] for g, starts in started(out).items()}


def all_started(out: Path, before: dict[str, int] | None = None) -> bool:
    now = latest(out)
    return len(now) == 3 and all(now[g] != (before or {}).get(g) for g in now)


def finish(proc: subprocess.Popen, out: Path, err: Path) -> str:
    (out / "go").touch()
    try:
        proc.wait(timeout=limit(120))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=limit(60))
    return err.read_text()


def test_a_killed_worker_restarts_in_its_group_only(tmp_path):
    proc, out, err = start(tmp_path)
    try:
        wait_for(lambda: all_started(out), 180, "3 groups' workers started")
        first = started(out)
        assert sorted(first) == ["0", "1", "2"]
        lighthouses = {s[0]["lighthouse"] for s in first.values()}
        assert len(lighthouses) == 1 and re.fullmatch(r"http://127\.0\.0\.1:\d+",
                                                      lighthouses.pop())
        assert all(s[0]["groups"] == "3" and s[0]["addr"] == "127.0.0.1"
                   for s in first.values())
        before = latest(out)
        subprocess.run(["kill", "-9", str(before["1"])], check=True)
        wait_for(lambda: len(started(out).get("1", [])) == 2, 120,
                 "group 1's worker restarted")
        after = latest(out)
        assert after["1"] != before["1"]
        assert after["0"] == before["0"] and after["2"] == before["2"]
        for g in ("0", "2"):  # never restarted: alive all along
            assert Path(f"/proc/{before[g]}").exists()
    finally:
        text = finish(proc, out, err)
    assert proc.returncode == 0, text
    assert "torchrun (replica group 1): rank 0 killed by SIGKILL" in text


def test_a_lost_lighthouse_is_one_line_and_every_group_starts_again(tmp_path):
    proc, out, err = start(tmp_path)
    try:
        wait_for(lambda: all_started(out), 180, "3 groups' workers started")
        before = latest(out)
        pid = int(re.search(r"\(the Lighthouse, pid (\d+);", err.read_text()).group(1))
        subprocess.run(["kill", "-9", str(pid)], check=True)
        wait_for(lambda: all_started(out, before), 240, "every group started again")
        text = err.read_text()
        lost = [ln for ln in text.splitlines() if f"the Lighthouse (pid {pid}," in ln]
        assert len(lost) == 1, text
        assert re.search(r"http://127\.0\.0\.1:\d+\) exited with code -9 while", lost[0])
        lighthouses = {s[-1]["lighthouse"] for s in started(out).values()}
        assert len(lighthouses) == 1  # the new one, shared by every group again
    finally:
        text = finish(proc, out, err)
    assert proc.returncode == 0, text


def test_sigterm_reaches_every_group_and_is_143(tmp_path):
    proc, out, err = start(tmp_path)
    try:
        wait_for(lambda: all_started(out), 180, "3 groups' workers started")
        below = procs.descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=limit(120))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.read_text()
    assert proc.returncode == 143, text
    assert text.strip().splitlines()[-1].startswith("stopped by SIGTERM")
    # every group's processes and the Lighthouse ended with the launcher
    wait_for(lambda: not any(procs.alive(p) for p in below), 30, "nothing left behind")


def test_a_pod_waits_for_the_deployments_new_lighthouse_and_gives_up_after_max_restarts(
        tmp_path):
    port = free_port()
    lighthouse = deployment_lighthouse(tmp_path, port)
    proc, out, err = pod(tmp_path, port)
    lost = rf"the Lighthouse \(its Deployment's, http://127\.0\.0\.1:{port}\) stopped " \
           r"accepting connections while 1 replica group\(s\) ran"
    try:
        wait_for(lambda: len(started(out).get("0", [])) == 1, 180, "group 0's worker")
        lighthouse.kill()
        lighthouse.wait()
        wait_for(lambda: re.search(lost + r".*\n(.*\n)*.*waiting for its Deployment's "
                                   r"Lighthouse", err.read_text()), 60,
                 "the pod waiting for a new Lighthouse")
        assert proc.poll() is None and len(re.findall(lost, err.read_text())) == 1
        lighthouse = deployment_lighthouse(tmp_path, port)  # the Deployment's replacement
        wait_for(lambda: len(started(out).get("0", [])) == 2, 180, "group 0 started again")
        lighthouse.kill()
        lighthouse.wait()
        assert proc.wait(timeout=limit(120)) == 1, err.read_text()
    finally:
        for p in (proc, lighthouse):
            if p.poll() is None:
                p.kill()
                p.wait()
    last = err.read_text().strip().splitlines()[-1]
    assert re.fullmatch(rf"error: training failed: {lost}, after 1 relaunch\(es\) "
                        r"\(distributed\.max_restarts\); .*", last), last
    assert len(re.findall("^entrypoint: " + lost, err.read_text(), re.M)) == 2  # one a loss
