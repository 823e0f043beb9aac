"""Replica groups (``distributed.fault_tolerance: replicas``) with a host per group, as
an Indexed Job's pods run them, against today's elastic restart with a vanished host,
side by side, on the network-namespace rig (tests/harness/netns.py; needs root).

The rig: hosts on one bridge (198.18.0.0/24, nothing leaves the machine), each a network,
PID, UTS and mount namespace. One runs the Lighthouse as its Deployment does
(``entrypoint.py lighthouse``); each group's host runs ``entrypoint.py train CONFIG``
with the Indexed Job's variables (docs/fault-tolerance.md, "On Kubernetes"):
JOB_COMPLETION_INDEX = its group, TRAIN_NNODES = the groups, a TRAIN_RDZV_ID per job,
TRAIN_LOCAL_ADDR = its address, TORCHFT_LIGHTHOUSE = the Lighthouse's. The convention
also needs TRAIN_RDZV_ENDPOINT; replica groups never use the job's rendezvous store, so
none runs. The run folder is shared by every host (a PersistentVolumeClaim's part).

Faults of group 1, ``--faults`` of each kind, each measured as bench/replicas.py measures
its own (bench/replica_faults.py: from the fault to the first step committed in
``RUN_DIR/ledger.jsonl`` that it held up; when group 1 trains again; the other groups'
worker pids before and after, unchanged when no survivor restarted), median and p95:

  (e)  2 groups + 1 spare, kill -9 of group 1's worker (its host's torchrun restarts it);
  (e') 2 groups, no spare, the same;
  (f)  2 groups + 1 spare, SIGSTOP of every process on group 1's host (its launcher,
       torchrun and worker: a frozen node), SIGCONT once measured;
  (g)  2 groups + 1 spare, group 1's host's link cut (no FIN, no RST), healed once
       measured;
  (h)  today's elastic restart (``fault_tolerance: restart``, 2 hosts of one process,
       the standalone store): one host's link cut -> the survivor's next step
       (bench/recovery.py's host_vanished, on the same model), ``--restarts`` times.

(e), (f) and (g) are faults of one job, in turn; (e') a job of its own. The config
(model, batch, logging, timeouts) is bench/replicas.py's. Each job is stopped with
SIGTERM (exit 143 on every host), every process is gone before its files are removed,
and every namespace is deleted, whatever ends the bench (an error, Ctrl-C, SIGTERM). The
defaults are short; numbers worth quoting want ``--faults 10`` on an idle machine.

    python -m bench.replicas_rig [--faults 3] [--restarts N]
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from bench.recovery import host_vanished
from bench.replica_faults import (
    VICTIM,
    Fault,
    LedgerWatch,
    Watched,
    fault,
    load,
    measure,
    p95,
    report,
    series,
    summary,
)
from bench.replicas import replica_config, restarts
from launcher.detection.torchft_tools import lighthouse_binary
from tests.harness import netns
from tests.harness.multinode import Process
from tests.harness.procs import descendants, replica_workers
from tests.harness.runs import ENTRY, clean_env

LIGHTHOUSE_PORT = 29510  # the first job's; each later job's the next
STORE_PORT = 29400
HOSTS = 3                # for groups: 2 replicas + 1 spare
GOAL_S = 5.0             # the issue's: p95 of the next committed step after a fault
STOP_S = 120


def pod_env(group: int, groups: int, job: str, addr: str, lighthouse: str) -> dict[str, str]:
    """The Indexed Job's variables of group ``group``'s pod at ``addr``
    (k8s/kustomize/replicas); ``lighthouse``: HOST:PORT of the Lighthouse, whose host
    is also named as the job's store (the convention's variable; not used by groups)."""
    host = lighthouse.rpartition(":")[0]
    return {"JOB_COMPLETION_INDEX": str(group), "TRAIN_NNODES": str(groups),
            "TRAIN_RDZV_ID": job, "TRAIN_RDZV_ENDPOINT": f"{host}:{STORE_PORT}",
            "TRAIN_LOCAL_ADDR": addr, "TORCHFT_LIGHTHOUSE": f"http://{lighthouse}"}


def verdict(values: list[float], goal: float = GOAL_S) -> str:
    """Whether the p95 of ``values`` meets the goal, in words."""
    worst = p95(values)
    return f"met ({worst:.2f} s)" if worst <= goal else f"missed ({worst:.2f} s)"


class Rig(netns.Rig):
    """The Lighthouse's host and one host per group (:meth:`open`, inside the ``with``
    block), and every process started on them."""

    def open(self) -> Rig:
        net = self.network()
        self.beacon = net.host("lighthouse")
        self.hosts = [net.host(f"group{g}") for g in range(HOSTS)]
        return self

    def start(self, host: netns.Host, label: str, args: list[str], env: dict) -> Process:
        """``entrypoint.py ARGS`` on ``host``."""
        return self.run(host, label, [sys.executable, ENTRY, *args], clean_env(**env))


class RigRun(Watched):
    """One job of replica groups on the rig: its Lighthouse, then a pod per group."""

    def __init__(self, rig: Rig, name: str, spares: int) -> None:
        self.rig, self.name, self.groups = rig, name, 2 + spares
        cfg = str(replica_config(rig.work, name, spares))
        port = LIGHTHOUSE_PORT + len(rig.procs)  # a fresh port: no old job's connections
        self.beacon = rig.start(rig.beacon, f"{name}-lighthouse", [
            "lighthouse", "--port", str(port), "--host", rig.beacon.addr, cfg], {})
        job = f"{name}-{uuid.uuid4().hex[:12]}"
        # each pod's launcher waits for the Lighthouse (distributed.rdzv_join_timeout_s)
        self.pods = [rig.start(rig.hosts[g], f"{name}-train", ["train", cfg],
                               pod_env(g, self.groups, job, rig.hosts[g].addr,
                                       f"{rig.beacon.addr}:{port}"))
                     for g in range(self.groups)]
        self.ledger = LedgerWatch(rig.work / "runs" / name / "ledger.jsonl")

    def workers(self) -> dict[int, int]:
        found = {}
        for pod in self.pods:
            found.update(replica_workers(pod.proc.pid))
        return found

    def stop(self) -> list[int]:
        """SIGTERM to every pod's launcher (every group checkpoints and stops: 143 each),
        killed after STOP_S; then the Lighthouse killed. Each pod's exit code."""
        for pod in self.pods:
            pod.signal(signal.SIGTERM)
        deadline, codes = time.monotonic() + STOP_S, []
        for pod in self.pods:
            try:
                codes.append(pod.proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pod.kill()
                codes.append(pod.proc.returncode)
        for p in (*self.pods, self.beacon):
            p.kill()  # nothing of it left (a no-op once it ended cleanly)
        return codes


def on_host(pod: Process) -> list[int]:
    """Every process of the pod's host (its PID namespace: the launcher, torchrun, the
    workers), parents first."""
    return sorted(descendants(pod.proc.pid))


def send(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def kill_worker(run: RigRun) -> Fault:
    return fault(run, signal.SIGKILL)


def freeze_host(run: RigRun) -> Fault:
    pod = run.pods[VICTIM]
    frozen = on_host(pod)  # read before the clock starts
    return measure(run, lambda: send(frozen, signal.SIGSTOP),
                   lambda: send(on_host(pod), signal.SIGCONT))


def cut_link(run: RigRun) -> Fault:
    host, net = run.rig.hosts[VICTIM], run.rig.net
    return measure(run, lambda: net.cut(host), lambda: net.heal(host))


def job(rig: Rig, name: str, spares: int, n: int,
        kinds: list[tuple[str, Callable[[RigRun], Fault]]]) -> list[list[Fault]]:
    """One job on the rig: ``n`` faults of each kind in turn, then stopped."""
    run = RigRun(rig, name, spares)
    try:
        return [series(run, label, n, functools.partial(one, run)) for label, one in kinds]
    finally:
        codes = run.stop()
        if any(code != 143 for code in codes):
            tails = "\n".join(f"--- {p.name}:\n{p.text()[-1500:]}" for p in run.pods)
            print(f"({name}) pods ended with {codes}, not 143 each:\n{tails}", flush=True)


def vanished(work: Path, args: list[str]) -> float:
    """(h): one elastic job of 2 hosts, one host's link cut -> the survivor's next step."""
    noticed, step = host_vanished(work, args)
    print(f"(h) the survivor noticed the lost host after {noticed:.2f} s", flush=True)
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=3, help="faults of each kind (>= 10 "
                        "for the issue's numbers)")
    parser.add_argument("--restarts", type=int, help="elastic restarts (default: --faults)")
    args = parser.parse_args(argv)
    if (why := netns.available()) is not None:
        print(f"error: the rig needs network namespaces (root): {why}; run bench.replicas "
              "for replica groups on 127.0.0.1", file=sys.stderr)
        return 3
    if lighthouse_binary() is None:
        print("error: replica groups need torchft and its torchft_lighthouse: make ft",
              file=sys.stderr)
        return 3
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the rig closes on the way out
    with tempfile.TemporaryDirectory(prefix="bench-replicas-rig-") as tmp:
        work = Path(tmp)
        for sub in ("rig", "h"):
            (work / sub).mkdir()
        print(f"load at the start {load()}", flush=True)
        with Rig(work / "rig") as rig:
            rig.open()
            e, f, g = job(rig, "spare", 1, args.faults, [
                ("e", kill_worker), ("f", freeze_host), ("g", cut_link)])
            e0, = job(rig, "nospare", 0, args.faults, [("e'", kill_worker)])
        h = restarts(work / "h", args.restarts or args.faults, "h", vanished)
    base = statistics.median(h)
    print(f"\nrecovery on the rig, a fault -> the next committed step (load at the end "
          f"{load()}):")
    report("(h) elastic restart, 2 hosts, one host's link cut", h, None)
    kinds = (("e", "2 groups + spare, kill -9 group 1's worker", e),
             ("e'", "2 groups, no spare, kill -9 group 1's worker", e0),
             ("f", "2 groups + spare, SIGSTOP group 1's host", f),
             ("g", "2 groups + spare, group 1's link cut", g))
    for label, name, values in kinds:
        summary(f"({label}) {name}", values, base)
    print(f"goal, p95 of the next committed step <= {GOAL_S:g} s: " + "; ".join(
        f"({label}) {verdict([x.next_step_s for x in values])}" for label, _, values in kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
