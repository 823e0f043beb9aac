"""Simulated nodes: the real ``entrypoint.py train`` (and ``rendezvous``) as local
processes, one per node, all on 127.0.0.1. Used by the multi-node tests and by
bench/recovery.py.

A node runs in its own PID namespace (``unshare --pid --fork --kill-child``) where the
kernel allows it, so that killing the node kills everything in it at once, as when a
machine or a pod dies; elsewhere the node is its process tree, killed by snapshot.
Each node is pinned to its own CPUs where there are enough, so that nodes do not
oversubscribe the machine (a real node has its own cores; the launcher sizes thread
pools from the CPUs a process may use).

Everything is bounded in time: waits take a timeout and raise, and :meth:`Node.kill`
and :meth:`Cluster.close` leave no process behind.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.harness.procs import alive, children, descendants
from tests.harness.runs import ENTRY, QUICKSTART, limit

# `entrypoint.py train`'s arguments for a job of simulated nodes: the quick start shrunk,
# trained until stopped, a checkpoint every 20 steps; a constant schedule, so that a
# reference run stopped at any step saw the same learning rates.
SMALL_JOB = [QUICKSTART, "model.depth=1", "model.width=32", "model.heads=4",
             "model.context_length=32", "train.global_batch_size=8", "data.max_bytes=200000",
             "data.num_workers=0", "schedule.name=constant", "schedule.warmup_steps=2",
             "train.eval_batches=1", "logging.every_steps=1", "logging.progress=plain",
             "checkpoint.every_steps=20", "train.max_steps=100000"]


def pid_namespaces() -> bool:
    """Can this process start a PID namespace (root, or user namespaces allowed)?"""
    if shutil.which("unshare") is None:
        return False
    for extra in ([], ["--user", "--map-root-user"]):
        try:
            ok = subprocess.run(["unshare", *extra, "--pid", "--fork", "--kill-child", "true"],
                                capture_output=True, timeout=limit(10)).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return True
    return False


def _unshare_prefix(hosts: Path | None = None) -> list[str]:
    """unshare for a PID namespace with its own /proc (the launcher finds its processes
    there, numbered as it sees them); with ``hosts``, that file is /etc/hosts in its mount
    namespace (so a pod's Service names resolve as the manifests write them)."""
    flags = ["--pid", "--fork", "--kill-child", "--mount-proc"]
    plain = ["unshare", *flags]
    if subprocess.run([*plain, "true"], capture_output=True,
                      timeout=limit(10)).returncode != 0:
        plain = ["unshare", "--user", "--map-root-user", *flags]
    if hosts is None:
        return plain
    return [*plain, "sh", "-c", f'mount --bind "{hosts}" /etc/hosts && exec "$@"', "sh"]


class Process:
    """A long-lived child whose output goes to a file, with bounded waits on it."""

    def __init__(self, name: str, argv: list[str], env: dict, cwd: Path,
                 cpus: set[int] | None = None, namespace: bool = False,
                 hosts: Path | None = None, wrap: list[str] | None = None) -> None:
        """wrap: a command prefix that starts a PID namespace of its own (a host of
        tests/harness/netns.py); instead of ``namespace``."""
        self.name, self.argv, self.env, self.cwd = name, argv, env, cwd
        self.cpus, self.hosts, self.wrap = cpus, hosts, wrap
        self.namespace = namespace or wrap is not None
        self.log = cwd / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> Process:
        self.starts += 1
        prefix = self.wrap or (_unshare_prefix(self.hosts) if self.namespace else [])
        cpus = self.cpus

        def setup() -> None:  # in the child, before exec
            if cpus:
                os.sched_setaffinity(0, cpus)

        out = self.log.open("a")
        out.write(f"===== start {self.starts}\n")
        out.flush()
        self.proc = subprocess.Popen([*prefix, *self.argv], cwd=self.cwd, env=self.env,
                                     stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=setup)
        out.close()
        return self

    def text(self) -> str:
        """This start's output so far."""
        try:
            return self.log.read_text(errors="replace").rsplit(f"===== start {self.starts}\n",
                                                               1)[-1]
        except OSError:
            return ""

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        timeout = limit(timeout)
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.text())
            if m:
                return m
            if self.proc is not None and self.proc.poll() is not None:
                m = re.search(pattern, self.text())  # the last lines before it ended
                if m:
                    return m
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}) before "
                                     f"{pattern!r}:\n{self.text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no {pattern!r} within {timeout} s:\n"
                                     f"{self.text()[-3000:]}")
            time.sleep(0.1)

    def wait(self, timeout: float) -> int:
        timeout = limit(timeout)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not end within {timeout} s:\n"
                                 f"{self.text()[-3000:]}") from None

    def signal(self, signum: int) -> None:
        """To the node's launcher (inside the namespace: unshare does not pass signals on)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        target = self.proc.pid
        if self.namespace:  # below unshare (and the sh that binds /etc/hosts, if any)
            below = children(self.proc.pid)
            if not below:
                return
            target = below[0]
        os.kill(target, signum)

    def kill(self) -> None:
        """Everything of this node dies at once (SIGKILL), as when its machine dies; returns
        once every one of its processes is gone (nothing writes to its files after)."""
        if self.proc is None:
            return
        tree = descendants(self.proc.pid)
        for pid in [self.proc.pid, *([] if self.namespace else tree)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=limit(30))
        deadline = time.monotonic() + limit(30)
        while any(alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def first(processes: list[Process], pattern: str, timeout: float = 180) -> Process:
    """The first of ``processes`` whose output matches (nodes and pods: ranks are assigned
    by the rendezvous, so which one gets there first is not known in advance)."""
    deadline = time.monotonic() + limit(timeout)
    while True:
        for p in processes:
            if re.search(pattern, p.text()):
                return p
        assert time.monotonic() < deadline, f"no {pattern!r}: " + processes[0].text()[-2000:]
        time.sleep(0.1)


class Cluster:
    """A rendezvous store and nodes of one job, in a work folder; closes everything."""

    def __init__(self, work: Path, env: dict, *, nnodes: str, run_id: str = "job-1",
                 namespaces: bool | None = None) -> None:
        self.work, self.base_env, self.nnodes, self.run_id = work, env, nnodes, run_id
        self.namespaces = pid_namespaces() if namespaces is None else namespaces
        self.store: Process | None = None
        self.port: int | None = None
        self.nodes: list[Process] = []

    def start_store(self, port: int = 0) -> Process:
        self.store = Process("store", [sys.executable, ENTRY, "rendezvous", "--port",
                                       str(port)], self.base_env, self.work,
                             namespace=self.namespaces).start()
        self.port = int(self.store.wait_for(r"listening on 0\.0\.0\.0:(\d+)", 60)[1])
        return self.store

    def node(self, index: int, args: list[str], **env: str) -> Process:
        """The pod of JOB_COMPLETION_INDEX ``index`` (Indexed Job convention)."""
        ncpu = len(os.sched_getaffinity(0))
        cpus = {sorted(os.sched_getaffinity(0))[index % ncpu]} if ncpu >= 2 else None
        node_env = {**self.base_env, "JOB_COMPLETION_INDEX": str(index),
                    "TRAIN_NNODES": self.nnodes, "TRAIN_RDZV_ID": self.run_id,
                    "TRAIN_RDZV_ENDPOINT": f"127.0.0.1:{self.port}",
                    "TRAIN_LOCAL_ADDR": "127.0.0.1", **env}
        node = Process(f"node{index}-{len(self.nodes)}", [sys.executable, ENTRY, "train", *args],
                       node_env, self.work, cpus=cpus, namespace=self.namespaces)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for p in [*self.nodes, *([self.store] if self.store else [])]:
            if p.running:
                p.kill()
