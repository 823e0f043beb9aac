"""The Lighthouse of replica groups (torchft's quorum service), as one launcher sees it.

- On one machine: started here on 127.0.0.1 at a free port, in a session of its own,
  deaf to SIGTERM and the requeue signal (the groups need it to finish their stop) and
  killed with the launcher (:func:`_outlives_stops`); its output goes to
  ``RUN_DIR/logs/lighthouse.log``; the groups start once its port accepts connections
  (at most :data:`LIGHTHOUSE_UP_S`). Lost: it exited.
- On SLURM (groups of one node or of several): node 0's launcher starts it at the
  first node's address and the job's port (a port something else holds is exit 3,
  naming it); the other nodes' launchers wait for it, bounded
  (``distributed.rdzv_join_timeout_s``), and watch it: lost when it refuses
  connections :data:`MISSES` times in a row. Node 0's launcher keeps it, after its own
  group ended, while any group still beats.
- On Kubernetes (k8s/kustomize/replicas) its own Deployment runs it behind a Service:
  every pod's launcher waits for it and watches it as SLURM's other nodes do.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from launcher.detection import system
from launcher.endings import verdicts
from launcher.endings.outcome import Outcome
from launcher.liveness.rounds import reachable
from launcher.planning.plan import Plan
from launcher.planning.replica_plan import HOST, fill, shell
from train.core.errors import EXIT_CANNOT_RUN_HERE
from train.core.machine.host import die_with_parent

LIGHTHOUSE_UP_S = 30.0   # from its start until its port accepts connections
CHECK_S = 1.0            # another node's Lighthouse: how often it is tried
MISSES = 3               # ... and how many refusals in a row mean it is lost


@dataclass
class Lighthouse:
    proc: subprocess.Popen | None   # None: another node's (SLURM: node 0's)
    port: int
    host: str = HOST
    misses: int = 0
    checked: float = 0.0
    by: str = "node 0's"            # whose it is, when another's

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def gone(self) -> str | None:
        """Why it is lost (None while it is not): it exited, or, another node's, it has
        refused connections MISSES times in a row."""
        if self.proc is not None:
            rc = self.proc.poll()
            return None if rc is None else f"exited with code {rc}"
        if time.monotonic() - self.checked < CHECK_S:
            return None
        self.checked = time.monotonic()
        self.misses = 0 if reachable(f"{self.host}:{self.port}") else self.misses + 1
        return "stopped accepting connections" if self.misses >= MISSES else None

    def beating(self) -> int:
        """How many groups' Managers it hears from now (its status page's count; 0 when
        it does not answer)."""
        try:
            with urllib.request.urlopen(f"{self.address}/status", timeout=2.0) as page:
                text = page.read().decode(errors="replace")
        except (OSError, ValueError):
            return 0
        found = re.search(r"\[(\d+) heartbeating\]", text)
        return int(found[1]) if found else 0

    def named(self) -> str:
        own = f"pid {self.proc.pid}, " if self.proc is not None else f"{self.by}, "
        return f"the Lighthouse ({own}{self.address})"


def _log_path(plan: Plan) -> Path:
    folder = Path(plan.log_dir or ".")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "lighthouse.log"


def _taken(host: str, port: int) -> bool:
    """Does something hold ``host:port`` here already (another job's server)?"""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def start(plan: Plan, keep_fds: tuple[int, ...], log) -> Lighthouse | Outcome:
    """This launcher's Lighthouse, up; or, on SLURM's nodes other than 0, node 0's."""
    groups = plan.replica_groups
    if groups.at is None:
        return _serve(plan, HOST, system.free_port(), LIGHTHOUSE_UP_S, log)
    host, _, port = groups.at.rpartition(":")
    if not groups.serve:
        return _wait(host, int(port), plan.join_timeout_s, log, groups.by)
    if _taken(host, int(port)):
        return Outcome(EXIT_CANNOT_RUN_HERE, f"error: the Lighthouse's port {groups.at} (the "
                                             "job's port: MASTER_PORT, else derived from "
                                             "SLURM_JOB_ID) is taken on this node; set "
                                             "MASTER_PORT to a free one")
    return _serve(plan, host, int(port), LIGHTHOUSE_UP_S, log)


def _wait(host: str, port: int, wait_s: float, log, by: str) -> Lighthouse | Outcome:
    log(f"waiting for {by} Lighthouse at http://{host}:{port} (at most {wait_s:.0f} s, "
        "distributed.rdzv_join_timeout_s)")
    deadline = time.monotonic() + wait_s
    while not reachable(f"{host}:{port}"):
        if time.monotonic() >= deadline:
            return verdicts.lighthouse_down(f"{by}, http://{host}:{port}",
                                            f"did not accept connections within "
                                            f"{wait_s:.0f} s", "node 0's RUN_DIR/logs"
                                            if by == "node 0's" else "kubectl logs")
        time.sleep(0.5)
    return Lighthouse(None, port, host, by=by)


def _serve(plan: Plan, host: str, port: int, wait_s: float, log) -> Lighthouse | Outcome:
    """Start it and wait, bounded, until its port accepts connections."""
    argv = fill(plan.replica_groups.lighthouse, LIGHTHOUSE_PORT=port)
    path = _log_path(plan)
    with path.open("ab") as out:
        # at INFO it writes lines for every quorum of every step (RUST_LOG=info: to see them)
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, env=env,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_outlives_stops(os.getpid(), plan.requeue_signal))
    log(f"run {shell(argv)} (the Lighthouse, pid {proc.pid}; its log {path})")
    deadline = time.monotonic() + wait_s
    while not reachable(f"{host}:{port}"):
        rc = proc.poll()
        if rc is not None:
            return verdicts.lighthouse_down(shell(argv), f"exited with code {rc} before it "
                                                         "accepted connections", str(path))
        if time.monotonic() >= deadline:
            end(proc, 5.0)
            return verdicts.lighthouse_down(shell(argv), f"did not accept connections on "
                                                         f"{host}:{port} within "
                                                         f"{wait_s:.0f} s", str(path))
        time.sleep(0.1)
    return Lighthouse(proc, port, host)


def _outlives_stops(launcher_pid: int, requeue: int | None):
    """The Lighthouse's setup between fork and exec: it ignores the signals that stop a
    job (SIGTERM, the requeue signal; SIGINT it takes over itself once it serves) and
    dies with the launcher by SIGKILL. A stop reaches every process of a SLURM step at
    once (scancel, a time limit, a preemption), the Lighthouse with the workers; without
    this the workers' current step never reaches a quorum and their stop checkpoint is
    lost (measured: all 4 workers of a 4-node job blocked in the quorum until SIGKILL,
    115 s later). Its launcher kills it once the groups ended (:func:`end`): it keeps
    no state."""
    def setup() -> None:
        for signum in {signal.SIGTERM, *([requeue] if requeue else [])}:
            signal.signal(signum, signal.SIG_IGN)  # inherited through exec
        die_with_parent(signal.SIGKILL, parent=launcher_pid)
    return setup


def end(proc: subprocess.Popen | None, wait_s: float) -> None:
    """Stop the Lighthouse: SIGKILL (it ignores SIGTERM, and keeps no state), and wait
    at most ``wait_s`` for it to go."""
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.kill()
        proc.wait(timeout=wait_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass  # gone already, or reaped by the launcher's exit
