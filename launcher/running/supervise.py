"""Run a plan as a supervised child and turn its ending into the documented exit codes.

torchrun exits 1 with a traceback both when a worker fails and when it is stopped
by SIGTERM, so its own code cannot be passed through. The launcher instead:

- starts the child (torchrun, or the worker itself for one process) in its own
  session, so a terminal's Ctrl-C reaches it once, through us, and with a
  parent-death signal, so it never outlives us (kill -9 of the launcher included);
- forwards SIGTERM/SIGINT to it at once (torchrun forwards to the workers, which
  checkpoint and exit 143);
- starts, asks and stops the watchers the plan chose for the other nodes and the store
  (:mod:`launcher.liveness.watchers`), without knowing which they are;
- reads each local worker's report (``train.worker``) and lets
  :mod:`launcher.endings.outcome` decide: 0 done, 143 stopped by a signal, 1 failed
  (naming the first failing rank), ...

For one process, ``distributed.max_restarts`` restarts the worker here, as torchrun
would. When torchrun loses the standalone rendezvous store (exit
:data:`~launcher.running.agent_contract.STORE_LOST`), the launcher waits, bounded, for the
store to come back and starts torchrun again: the nodes re-rendezvous and resume from the
last checkpoint, without a pod restart (exit 5 if it does not come back).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from launcher.endings import verdicts as endings
from launcher.endings.outcome import Outcome, classify
from launcher.endings.restarts import STOPPED_BY_LAUNCHER, failed_attempt, restarting
from launcher.liveness import watchers
from launcher.liveness.rounds import reachable
from launcher.liveness.watchers import Child, Liveness
from launcher.planning.plan import Plan
from launcher.running.agent_contract import LOCAL_ID_VAR, STORE_LOST
from launcher.running.processes import kill_tree, stop_workers, workers_alive
from launcher.running.signals import Forwarder
from train.core.errors import EXIT_CANNOT_RUN_HERE, EXIT_STOPPED_BY_SIGNAL, EXIT_TRAINING_FAILED
from train.core.files import write_atomic
from train.core.machine.host import die_with_parent
from train.core.run import failure_log, protocol
from train.core.run.identity import CONFIG_SNAPSHOT_VAR, RELAUNCH_VAR, STATUS_DIR_VAR
from train.core.run.protocol import Report
from train.core.storage.credentials import redacted


def read_reports(folder: Path) -> list[Report]:
    """The latest report of each rank (elastic restarts renumber ranks: keep the last round)."""
    return protocol.latest_round(protocol.read_all(folder))


def child_setup(launcher_pid: int, ignored: int | None = None) -> Callable[[], None]:
    """Runs in the child between fork and exec: it gets SIGTERM when the launcher dies,
    even by kill -9, and then checkpoints and stops like on any SIGTERM (torchrun passes
    it on to the workers), instead of training on unsupervised. ``ignored``: a signal
    the child and its descendants ignore (SLURM's requeue signal reaches every process
    of the step, and would kill torchrun and the workers: the launcher turns it into
    their SIGTERM)."""
    def setup() -> None:
        if ignored is not None:
            signal.signal(ignored, signal.SIG_IGN)  # inherited through exec
        die_with_parent(signal.SIGTERM, parent=launcher_pid)
    return setup


# A flapping store could otherwise relaunch forever; each relaunch resumes from a checkpoint.
MAX_STORE_RELAUNCHES = 10


def run(plan: Plan, base_env: Mapping[str, str], log: Callable[[str], None],
        keep_fds: tuple[int, ...] = (), verbose: bool = False,
        config_text: str | None = None,
        abort: Callable[[], str | None] | None = None,
        forwarder: Forwarder | None = None) -> Outcome:
    """Start the plan's command, forward signals, restart (direct mode) or relaunch (the
    rendezvous store came back), map the result. keep_fds: descriptors the child inherits
    (the run-directory lock, so that it is held as long as any process of the run lives);
    verbose: also log the variables set for each start; config_text: the validated
    config, which every worker start of this launch reads instead of the file; abort:
    a reason to stop at once, when there is one (the run directory's lease was lost):
    every process of the child is killed, nothing more is written, exit 6; forwarder: the
    signal handling, when the caller wants to know afterwards what arrived."""
    folder = Path(tempfile.mkdtemp(prefix="train-launcher-"))
    env = {**base_env, **plan.env, STATUS_DIR_VAR: str(folder)}
    if config_text is not None:
        write_atomic(folder / protocol.CONFIG_SNAPSHOT, config_text)
        env[CONFIG_SNAPSHOT_VAR] = str(folder / protocol.CONFIG_SNAPSHOT)
    if verbose:
        log(f"set {STATUS_DIR_VAR}={folder} (where workers report how they ended)")
    forwarder = forwarder or Forwarder(plan.requeue_signal)
    forwarder.install()
    try:
        outcome = _attempts(plan, env, folder, keep_fds, forwarder, log, verbose, abort)
    finally:
        forwarder.restore()
        shutil.rmtree(folder, ignore_errors=True)
    if outcome.message:  # a worker's error as it said it: credentials hidden
        print(redacted(outcome.message), file=sys.stderr, flush=True)
    return outcome


def _attempts(plan: Plan, env: dict, folder: Path, keep_fds: tuple[int, ...],
              forwarder: Forwarder, log: Callable[[str], None], verbose: bool,
              abort: Callable[[], str | None] | None) -> Outcome:
    """Start the child until it ends for good: a restart (direct mode, like torchrun's)
    after a failure a restart can help, a relaunch after the store came back."""
    restarts = relaunches = 0
    outcome = Outcome(EXIT_STOPPED_BY_SIGNAL, "stopped by a signal before training started")
    while not forwarder.received:
        if plan.mode == "direct":
            env["TORCHELASTIC_RESTART_COUNT"] = str(restarts)
            if verbose or restarts:
                log(f"set TORCHELASTIC_RESTART_COUNT={restarts}")
        for stale in (protocol.ATTEMPTS, STOPPED_BY_LAUNCHER,  # torchrun counts from 0 again
                      failure_log.STOPPING_AFTER_FAILURE):
            (folder / stale).unlink(missing_ok=True)
        rc, ended = _start_and_wait(plan, env, keep_fds, forwarder, log, abort)
        if ended is not None:  # the lease was lost, or a static job's node vanished
            return ended
        found = read_reports(folder)
        outcome = _classify(plan, rc, found, folder, forwarder.received)
        if forwarder.received:
            return outcome
        if rc == STORE_LOST and plan.store:
            if relaunches == MAX_STORE_RELAUNCHES:
                return endings.store_gone(plan.store, plan.store_wait_s, relaunches + 1)
            if not _store_returns(plan, forwarder, log):
                return endings.store_gone(plan.store, plan.store_wait_s, None)
            relaunches += 1
            env[RELAUNCH_VAR] = str(relaunches)
            log(f"set {RELAUNCH_VAR}={relaunches} (the same run, joining again)")
            continue
        if outcome.code == EXIT_TRAINING_FAILED and plan.static_nodes:
            return endings.static_failed(outcome, plan.convention)
        if not _restart(plan, outcome, found, restarts):
            return outcome
        restarts += 1
        log(_restarting_the_worker(plan, rc, found, restarts))
    return outcome


def _classify(plan: Plan, rc: int, found: list[Report], folder: Path,
              signals: list[int]) -> Outcome:
    """The outcome, from the reports and torchrun's record of how the last attempt's
    processes ended (which names a worker that died without a word)."""
    attempt = protocol.last_attempt(folder, found)
    exits = attempt.exits if attempt else []
    host = attempt.host if attempt and plan.nnodes[1] > 1 else None
    if plan.mode == "direct" and not signals:
        exits, host = _direct_exit(plan, rc, found), None
    return classify(rc, found, signals, plan.nproc_per_node, plan.mode, plan.program,
                    exits, host)


def _direct_exit(plan: Plan, rc: int, found: list[Report]) -> list[protocol.Exit]:
    """The one worker run directly, as torchrun would record it when it ended without a
    report (a signal, a crash): what names it and how it ended."""
    if rc == 0 or any(r.exit_code is not None for r in found):
        return []
    rank = found[0].rank if found else int(plan.env.get("RANK", "0") or 0)
    return [protocol.Exit(rank, 0, rc, first=True)]


def _restarting_the_worker(plan: Plan, rc: int, found: list[Report], number: int) -> str:
    """Direct mode's line for a restart, in torchrun's words (launcher.torchrun)."""
    what, _ = failed_attempt(found, _direct_exit(plan, rc, found), 1)
    return restarting(what, number, plan.max_restarts, "worker")


def _restart(plan: Plan, outcome: Outcome, found: list[Report], restarts: int) -> bool:
    """Direct mode restarts the worker itself, as torchrun would, while a restart can help."""
    repeated = any(r.repeated is not None for r in found)
    return plan.mode == "direct" and outcome.code == EXIT_TRAINING_FAILED and \
        protocol.restart_can_help(outcome.code, repeated) and restarts < plan.max_restarts


def _bind(liveness: Liveness) -> Outcome | None:
    """The watchers' early part, before any worker starts (a static job's rank-0 node
    binds its heartbeat port): exit 3 naming what this machine cannot do."""
    why = liveness.bind()
    return None if why is None else Outcome(EXIT_CANNOT_RUN_HERE, why)


def _start_and_wait(plan: Plan, env: dict, keep_fds: tuple[int, ...],
                    forwarder: Forwarder, log: Callable[[str], None],
                    abort: Callable[[], str | None] | None) -> tuple[int, Outcome | None]:
    """(the child's exit status, the outcome when the launcher ended it: its lease was
    lost, or a static job's node vanished). The plan's watchers
    (:mod:`launcher.liveness.watchers`) look after the nodes while it runs."""
    local_id = secrets.randbits(31)  # this start's rendezvous identity (launcher.torchrun)
    liveness = watchers.for_plan(plan, log)
    try:
        refused = _bind(liveness)
        if refused is not None:
            return 0, refused
        if plan.store and plan.job:
            env = {**env, LOCAL_ID_VAR: str(local_id)}
        proc = subprocess.Popen(list(plan.argv), env=env, start_new_session=True,
                                pass_fds=keep_fds,
                                preexec_fn=child_setup(os.getpid(), plan.requeue_signal))
        forwarder.attach(proc)
        liveness.start(Child(proc.pid, local_id,
                             lambda what, then: stop_workers(proc.pid, what, then, log,
                                                             env.get(STATUS_DIR_VAR)),
                             lambda: workers_alive(proc.pid), env.get(STATUS_DIR_VAR)))
        rc, reason = _wait(proc, liveness, log, abort)
        forwarder.proc = None
        if reason:
            return rc, endings.lease_lost(reason)
        lost = liveness.lost(rc, bool(forwarder.received))
        if lost:  # a static job's node vanished: every node stops, naming it
            return rc, endings.node_lost(lost.what, plan.convention)
        return rc, None
    finally:
        liveness.stop()


def _wait(proc: subprocess.Popen, liveness: Liveness, log: Callable[[str], None],
          abort: Callable[[], str | None] | None) -> tuple[int, str | None]:
    """(the child's exit status, the reason to abort when there was one). A store the
    watchers found lost while no worker runs ends the child as STORE_LOST: torchrun would
    meet again at a store that vanished, each of its calls waiting a minute and more."""
    while True:
        try:
            return proc.wait(timeout=0.5), None
        except subprocess.TimeoutExpired:
            reason = abort() if abort is not None else None
            if reason:  # no checkpoint, no more writes: every process at once
                kill_tree(proc.pid)
                return proc.wait(), reason
            lost = liveness.lost()
            if lost is not None and lost.kind == "store":
                log(lost.what)
                kill_tree(proc.pid)
                proc.wait()
                return STORE_LOST, None


def _store_returns(plan: Plan, forwarder: Forwarder, log: Callable[[str], None],
                   poll_s: float = 1.0) -> bool:
    """Wait, bounded, until the rendezvous store accepts connections again (on
    Kubernetes its Deployment restarts it within seconds); False on timeout or a signal."""
    log(f"the rendezvous store {plan.store} is unreachable (the workers checkpointed); "
        f"waiting up to {plan.store_wait_s} s for it to come back "
        "(distributed.rdzv_store_wait_s)")
    deadline = time.monotonic() + plan.store_wait_s
    said = time.monotonic()
    while not forwarder.received:
        if reachable(plan.store):
            log(f"the rendezvous store {plan.store} is back: joining the job again; it "
                "resumes from its last checkpoint")
            return True
        if time.monotonic() >= deadline:
            return False
        if time.monotonic() - said >= 30:
            left = deadline - time.monotonic()
            log(f"still waiting for the rendezvous store {plan.store} ({left:.0f} s left)")
            said = time.monotonic()
        time.sleep(poll_s)
    return False
