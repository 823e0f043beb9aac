"""Run replica groups (``distributed.fault_tolerance: replicas``) on one machine: the
Lighthouse, then one torchrun per group, supervised together.

- The Lighthouse (torchft's quorum service) starts first (:mod:`launcher.running.
  lighthouse`); the groups start once its port accepts connections.
- Each group is one torchrun with its own rendezvous (127.0.0.1, a free port), its own
  workers' status folder (``TRAIN_STATUS_DIR``: the ranks of different groups number
  alike) and its own restarts (``--max-restarts``): a group restarts its workers while
  the others train on, their processes untouched.
- SIGTERM/SIGINT go to every group (:class:`~launcher.running.signals.Forwarder`); the
  job ends when every group has ended: 0 when one group finished (the live groups end
  together at ``train.max_steps``), each other group named in one line; 143 after a
  stop; otherwise the first failure, as :mod:`launcher.endings.outcome` words one
  torchrun's.
- A Lighthouse that exits while groups run is said in one line; then today's restart:
  every group stops (SIGTERM: a checkpoint; then, bounded, SIGKILL) and the Lighthouse
  and the groups start again, resuming from the last checkpoint, at most
  ``distributed.max_restarts`` times.
- On Kubernetes (k8s/kustomize/replicas) this launcher runs its pod's group alone; the
  Lighthouse is its own Deployment's. A lost one is said in one line; the group stops
  as above and starts again once the Deployment's replacement accepts connections,
  resuming from the last checkpoint (healing from a group still ahead), at most
  ``distributed.max_restarts`` times; then exit 1, and the Job recreates the pod.
- On SLURM this launcher runs its node's group alone (node 0 also the Lighthouse).
  A lost Lighthouse is said on every node, which stops its group the same way and exits
  1 (a retry can fix it: resubmit, or ``scontrol requeue``): one node cannot start it
  again for the others. Node 0 keeps it, after its own group ended (finished or gave
  up), while the other nodes' groups beat.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from launcher.detection import system
from launcher.endings import verdicts
from launcher.endings.outcome import Outcome, classify
from launcher.planning.plan import SHUTDOWN_TIMEOUT_VAR, Plan
from launcher.planning.replica_plan import fill, shell
from launcher.running import lighthouse as beacon
from launcher.running.lighthouse import Lighthouse
from launcher.running.processes import kill_tree
from launcher.running.signals import Forwarder
from launcher.running.supervise import child_setup, read_reports
from train.core.errors import EXIT_OK, EXIT_STOPPED_BY_SIGNAL
from train.core.files import write_atomic
from train.core.run import protocol
from train.core.run.identity import CONFIG_SNAPSHOT_VAR, RELAUNCH_VAR, STATUS_DIR_VAR
from train.core.storage.credentials import redacted

LINGER_S = 3.0   # SLURM, node 0: its own group's heartbeat expires (2 s)
POLL_S = 0.5
Log = Callable[[str], None]


@dataclass
class Group:
    index: int
    folder: Path                      # its workers' reports
    proc: subprocess.Popen
    outcome: Outcome | None = None    # once its torchrun has ended
    ended_at: float = 0.0


def run(plan: Plan, base_env: Mapping[str, str], log: Log, keep_fds: tuple[int, ...] = (),
        verbose: bool = False, config_text: str | None = None,
        abort: Callable[[], str | None] | None = None,
        forwarder: Forwarder | None = None) -> Outcome:
    """:func:`launcher.running.supervise.run`'s counterpart for replica groups (the same
    arguments and meaning)."""
    folder = Path(tempfile.mkdtemp(prefix="train-launcher-"))
    env = {**base_env, **plan.env}
    if config_text is not None:  # every group's workers read the validated config
        write_atomic(folder / protocol.CONFIG_SNAPSHOT, config_text)
        env[CONFIG_SNAPSHOT_VAR] = str(folder / protocol.CONFIG_SNAPSHOT)
    forwarder = forwarder or Forwarder(plan.requeue_signal)
    forwarder.install()
    try:
        outcome = _launches(plan, env, folder, keep_fds, forwarder, log, verbose, abort)
    finally:
        forwarder.restore()
        shutil.rmtree(folder, ignore_errors=True)
    if outcome.message:
        print(redacted(outcome.message), file=sys.stderr, flush=True)
    return outcome


def _launches(plan: Plan, env: dict, folder: Path, keep_fds: tuple[int, ...],
              forwarder: Forwarder, log: Log, verbose: bool,
              abort: Callable[[], str | None] | None) -> Outcome:
    """Start the Lighthouse and the groups until they end, again after a lost Lighthouse
    (at most distributed.max_restarts times)."""
    relaunches = 0
    while True:
        outcome, lost = _launch(plan, env, folder, keep_fds, forwarder, log, verbose, abort)
        if lost is None:
            return outcome
        groups = plan.replica_groups
        if groups.at and not groups.owner:  # SLURM: node 0 could not start it for all
            return verdicts.lighthouse_lost_on_nodes(lost)
        if relaunches >= plan.max_restarts:
            return verdicts.lighthouse_lost(lost, relaunches, pod=bool(groups.at))
        relaunches += 1
        env[RELAUNCH_VAR] = str(relaunches)
        what = "this pod's replica group, once the Lighthouse is back," if groups.owner \
            else "the Lighthouse and the replica groups"
        log(f"starting {what} again ({relaunches} of {plan.max_restarts}, "
            "distributed.max_restarts): they resume from the last checkpoint")


def _launch(plan: Plan, env: dict, folder: Path, keep_fds: tuple[int, ...],
            forwarder: Forwarder, log: Log, verbose: bool,
            abort: Callable[[], str | None] | None) -> tuple[Outcome | None, str | None]:
    """One start of everything: (the outcome, None), or (None, the line saying the
    Lighthouse was lost) when the groups were stopped for that."""
    if forwarder.received:
        return Outcome(EXIT_STOPPED_BY_SIGNAL, "stopped by a signal before training "
                                               "started"), None
    lighthouse = beacon.start(plan, keep_fds, log)
    if isinstance(lighthouse, Outcome):
        return lighthouse, None
    groups: list[Group] = []
    outcome: tuple[Outcome | None, str | None] = (None, None)
    try:
        used = {lighthouse.port}
        for i, g in enumerate(plan.replica_groups.here):
            groups.append(_start_group(plan, env, folder, i, g, lighthouse, used, keep_fds,
                                       forwarder, log, verbose))
        outcome = _watch(plan, groups, lighthouse, forwarder, log, abort)
        return outcome
    finally:
        forwarder.others.clear()
        _stop_groups([g for g in groups if g.proc.poll() is None], 5.0, log)
        if plan.replica_groups.at and outcome[1] is None:
            _serve_others(lighthouse, forwarder, log)
        beacon.end(lighthouse.proc, 5.0)


def _serve_others(lighthouse: Lighthouse, forwarder: Forwarder, log: Log) -> None:
    """SLURM's node 0, its own group ended: the Lighthouse stays while the other nodes'
    groups beat (they may train on, or be finishing the same last step), until a
    signal."""
    if lighthouse.proc is None or lighthouse.proc.poll() is not None:
        return
    time.sleep(LINGER_S)  # this node's own Manager leaves the count
    if lighthouse.beating() and not forwarder.received:
        log("this node's replica group ended; keeping the Lighthouse up while the other "
            "nodes' groups beat")
    while lighthouse.beating() and not forwarder.received and lighthouse.proc.poll() is None:
        time.sleep(1.0)


def _free_port(used: set[int]) -> int:
    """A free port none of this start's other servers was given."""
    port = system.free_port()
    while port in used:
        port = system.free_port()
    used.add(port)
    return port


def _start_group(plan: Plan, env: dict, folder: Path, i: int, g: int, lighthouse: Lighthouse,
                 used: set[int], keep_fds: tuple[int, ...], forwarder: Forwarder, log: Log,
                 verbose: bool) -> Group:
    """Group ``g``'s torchrun (the ``i``-th here): its variables, its rendezvous port,
    its status folder."""
    reports = folder / f"group-{g}"
    shutil.rmtree(reports, ignore_errors=True)  # a relaunch's groups start afresh
    reports.mkdir()
    ports = {"LIGHTHOUSE_PORT": lighthouse.port, "RDZV_PORT": _free_port(used)}
    own = {k: fill((v,), **ports)[0] for k, v in plan.replica_groups.envs[i].items()}
    argv = fill(plan.replica_groups.argvs[i], **ports)
    proc = subprocess.Popen(argv, env={**env, **own, STATUS_DIR_VAR: str(reports)},
                            start_new_session=True, pass_fds=keep_fds,
                            preexec_fn=child_setup(os.getpid(), plan.requeue_signal))
    forwarder.attach_another(proc)
    shown = " ".join(f"{k}={v}" for k, v in own.items())
    log(f"replica group {g} (pid {proc.pid}): {shown} {shell(argv) if verbose else ''}".rstrip())
    return Group(g, reports, proc)


def _watch(plan: Plan, groups: list[Group], lighthouse: Lighthouse, forwarder: Forwarder,
           log: Log, abort: Callable[[], str | None] | None
           ) -> tuple[Outcome | None, str | None]:
    """Until every group has ended, the lease is lost, or the Lighthouse is."""
    while True:
        for g in groups:
            rc = g.proc.poll() if g.outcome is None else None
            if rc is not None:
                _ended(plan, g, rc, forwarder.received, groups, log)
        if all(g.outcome is not None for g in groups):
            return _combine(plan, groups, forwarder.received), None
        reason = abort() if abort is not None else None
        if reason:  # no checkpoint, no more writes: every process at once
            for g in groups:
                kill_tree(g.proc.pid)
            return verdicts.lease_lost(reason), None
        why = lighthouse.gone() if not forwarder.received else None
        if why:
            return None, _lost(plan, groups, lighthouse, why, log)
        time.sleep(POLL_S)


def _ended(plan: Plan, g: Group, rc: int, signals: list[int], groups: list[Group],
           log: Log) -> None:
    """A group's torchrun ended: its outcome, from its own workers' reports; one line
    when it ended otherwise than done while others train on."""
    found = read_reports(g.folder)
    attempt = protocol.last_attempt(g.folder, found)
    g.outcome = classify(rc, found, signals, plan.nproc_per_node, "torchrun", plan.program,
                         attempt.exits if attempt else [], None)
    g.ended_at = time.monotonic()
    if g.outcome.code not in (EXIT_OK, EXIT_STOPPED_BY_SIGNAL) or \
            (g.outcome.code == EXIT_STOPPED_BY_SIGNAL and not signals):
        left = sum(1 for o in groups if o.outcome is None)
        more = f"; {left} other group(s) train on" if left else ""
        log(redacted(verdicts.group_ended(g.index, g.outcome, plan.max_restarts)) + more)


def _combine(plan: Plan, groups: list[Group], signals: list[int]) -> Outcome:
    """The job's ending from every group's: a stop, else done when one group finished
    (the others were named as they ended), else the first failure, its group named."""
    outcomes = [g.outcome for g in groups]
    stopped = next((o for o in outcomes if o.code == EXIT_STOPPED_BY_SIGNAL), None)
    if signals and stopped is not None:
        return stopped
    if any(o.code == EXIT_OK for o in outcomes):
        return Outcome(EXIT_OK)
    first = min(groups, key=lambda g: g.ended_at)
    message = first.outcome.message or f"error: exit code {first.outcome.code}"
    return Outcome(first.outcome.code,
                   message.replace("error: ", f"error: replica group {first.index}: ", 1),
                   first.outcome.unfit_hosts)


# How long the groups get to stop once the Lighthouse is lost.
LOST_LIGHTHOUSE_STOP_S = 15.0


def _lost(plan: Plan, groups: list[Group], lighthouse: Lighthouse, why: str, log: Log) -> str:
    """The Lighthouse was lost while groups ran: one line, then every group stops; this
    node's group killed at once when the Lighthouse is another node's (only this node may
    have lost it)."""
    running = [g for g in groups if g.proc.poll() is None]
    line = f"{lighthouse.named()} {why} while {len(running)} replica group(s) ran"
    again = "to end" if plan.replica_groups.at and not plan.replica_groups.owner \
        else "to start again from the last checkpoint"
    if lighthouse.proc is None:
        # Seen from this node alone, it may be this node that lost the network, not the
        # Lighthouse. A worker told to stop (SIGTERM) carries its stop flag in the next
        # step's all-reduce across the groups: once the link is back, every group would
        # stop and restart with it. Killed, this group alone restarts, healing from a live
        # peer; and with the Lighthouse really gone, no step could commit to hold a
        # checkpoint anyway.
        log(f"{line}; killing this node's replica group {again}")
        for g in running:
            kill_tree(g.proc.pid)  # torchrun and its workers (sessions of their own)
            g.proc.wait()
        return line
    # Without it no group gets a quorum, so none can agree on a step to checkpoint at;
    # a step in flight may still end, the rest waits for nothing: a short bound.
    grace = min(float(plan.env.get(SHUTDOWN_TIMEOUT_VAR, "25")) + 5.0, LOST_LIGHTHOUSE_STOP_S)
    log(f"{line}; stopping every group (killed after {grace:.0f} s) {again}")
    _stop_groups(running, grace, log)
    return line


def _stop_groups(groups: list[Group], wait_s: float, log: Log) -> None:
    """SIGTERM to each group's torchrun (its workers checkpoint and exit); after
    ``wait_s``, SIGKILL to whatever of a group is left."""
    for g in groups:
        _signal(g.proc, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    for g in groups:
        try:
            g.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log(f"replica group {g.index} did not stop within {wait_s:.0f} s; killing it")
            kill_tree(g.proc.pid)
            g.proc.wait()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
