"""Run a plan as a supervised child and turn its ending into the documented exit codes.

torchrun exits 1 with a traceback both when a worker fails and when it is stopped
by SIGTERM, so its own code cannot be passed through. The launcher instead:

- starts the child (torchrun, or the worker itself for one process) in its own
  session, so a terminal's Ctrl-C reaches it once, through us, and with a
  parent-death signal, so it never outlives us (kill -9 of the launcher included);
- forwards SIGTERM/SIGINT to it at once (torchrun forwards to the workers, which
  checkpoint and exit 143);
- reads each local worker's report (``launcher.worker``) and decides:
  0 done, 143 stopped by a signal, 1 failed (naming the first failing rank).

For one process, ``distributed.max_restarts`` restarts the worker here, as torchrun
would.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from launcher import reports
from launcher.plan import Plan
from launcher.reports import Report
from train.errors import (EXIT_OK, EXIT_STOPPED_BY_SIGNAL, EXIT_TRAINING_FAILED,
                          FINAL_EXIT_CODES)
from train.host import die_with_parent
from train.worker_env import STATUS_DIR_VAR

FORWARDED = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class Outcome:
    code: int
    message: str | None = None


class Forwarder:
    """Signal handlers that pass SIGTERM/SIGINT on to the current child."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.received: list[int] = []
        self._old: dict[int, object] = {}

    def install(self) -> None:
        for sig in FORWARDED:
            self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def attach(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        for sig in self.received:  # arrived while the child was starting
            proc.send_signal(sig)


def read_reports(folder: Path) -> list[Report]:
    """The latest report of each rank (elastic restarts renumber ranks: keep the last round)."""
    return reports.latest_round(reports.read_all(folder))


def classify(rc: int, found: list[Report], signals: list[int], expected: int,
             mode: str) -> Outcome:
    """Map the child's exit status and the workers' reports to the user's exit code."""
    failed = [r for r in found if r.exit_code not in (EXIT_OK, EXIT_STOPPED_BY_SIGNAL)]
    # The first to fail is the root cause; the others usually fail because it vanished.
    failed.sort(key=lambda r: (r.time, r.rank))
    if failed:
        r = failed[0]
        if r.exit_code in FINAL_EXIT_CODES:  # the worker's own one-line message says it all
            if mode == "direct":
                return Outcome(r.exit_code)  # already the last line of its output
            return Outcome(r.exit_code, r.error or f"error: rank {r.rank} exited "
                                                   f"{r.exit_code}; see its output above")
        code = EXIT_TRAINING_FAILED
        where = f"its log {r.log_dir}/stderr.log" if r.log_dir else "its output above"
        what = r.error or f"exit code {r.exit_code}"
        more = f" ({len(failed) - 1} more rank(s) failed)" if len(failed) > 1 else ""
        return Outcome(code, f"error: training failed: rank {r.rank}: {what}{more}; "
                             f"details in {where}")
    stopped = [r for r in found if r.exit_code == EXIT_STOPPED_BY_SIGNAL]
    if signals or stopped:
        if rc == 0 and not stopped and len(found) >= expected:
            return Outcome(EXIT_OK)  # the signal came as the last step finished
        name = signal.Signals(signals[0]).name if signals else "a signal to a worker"
        unsure = "" if len(stopped) >= expected else \
            f" ({len(stopped)} of {expected} local worker(s) confirmed their checkpoint)"
        return Outcome(EXIT_STOPPED_BY_SIGNAL, f"stopped by {name}{unsure}; rerun the same "
                                               "command to resume from the last checkpoint")
    if rc == 0:
        return Outcome(EXIT_OK)
    if rc < 0 or not found:
        how = (f"was killed by {signal.Signals(-rc).name}" if rc < 0
               else f"exited with code {rc}")
        who = "the worker" if mode == "direct" else "torchrun"
        why = " before any worker reported (startup or rendezvous failure)" if not found else ""
        return Outcome(EXIT_TRAINING_FAILED,
                       f"error: training failed: {who} {how}{why}; a worker killed without "
                       "a report is often out of memory (dmesg, kubectl describe pod) or the "
                       "hang watchdog (stack dump in its log); see the log above")
    missing = max(0, expected - len(found))
    return Outcome(EXIT_TRAINING_FAILED,
                   f"error: training failed: {missing} local worker(s) ended without a report "
                   f"(killed, e.g. out of memory) and torchrun exited with code {rc}; see the "
                   "log above")


def _child_setup(launcher_pid: int) -> Callable[[], None]:
    """Runs in the child between fork and exec: it gets SIGTERM when the launcher dies,
    even by kill -9, and then checkpoints and stops like on any SIGTERM (torchrun passes
    it on to the workers), instead of training on unsupervised."""
    return lambda: die_with_parent(signal.SIGTERM, parent=launcher_pid)


def run(plan: Plan, base_env: Mapping[str, str], log: Callable[[str], None],
        keep_fds: tuple[int, ...] = ()) -> int:
    """Start the plan's command, forward signals, restart (direct mode), map the result.
    keep_fds: descriptors the child inherits (the run-directory lock, so that it is held
    as long as any process of the run lives)."""
    folder = Path(tempfile.mkdtemp(prefix="train-launcher-"))
    env = {**base_env, **plan.env, STATUS_DIR_VAR: str(folder)}
    log(f"set {STATUS_DIR_VAR}={folder} (where workers report how they ended)")
    forwarder = Forwarder()
    forwarder.install()
    attempts = plan.max_restarts + 1 if plan.mode == "direct" else 1
    outcome = Outcome(EXIT_STOPPED_BY_SIGNAL, "stopped by a signal before training started")
    try:
        for attempt in range(attempts):
            if forwarder.received:
                break
            if plan.mode == "direct":
                env["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
                log(f"set TORCHELASTIC_RESTART_COUNT={attempt}")
            proc = subprocess.Popen(list(plan.argv), env=env, start_new_session=True,
                                    pass_fds=keep_fds, preexec_fn=_child_setup(os.getpid()))
            forwarder.attach(proc)
            rc = proc.wait()
            forwarder.proc = None
            outcome = classify(rc, read_reports(folder), forwarder.received,
                               plan.nproc_per_node, plan.mode)
            if outcome.code != EXIT_TRAINING_FAILED or forwarder.received \
                    or attempt + 1 == attempts:
                break
            log(f"worker failed; restart {attempt + 1} of {plan.max_restarts}")
    finally:
        forwarder.restore()
        shutil.rmtree(folder, ignore_errors=True)
    if outcome.message:
        print(outcome.message, file=sys.stderr, flush=True)
    return outcome.code
