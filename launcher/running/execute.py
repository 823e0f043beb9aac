"""Running a prepared launch (:func:`launcher.running.runner.prepare`'s result): the notes and
warnings, the run-directory lock (``train``), the wait for the rendezvous host, then
the supervised child (:mod:`launcher.running.supervise`), and SLURM's requeue after a stop for
its signal.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from typing import TYPE_CHECKING

from launcher.detection import system
from launcher.running.prepared import Prepared
from launcher.running.requeue import requeue, requeue_without
from train.core.errors import EXIT_STOPPED_BY_SIGNAL
from train.core.run import rundir

if TYPE_CHECKING:
    from launcher.endings.outcome import Outcome
    from launcher.running.signals import Forwarder
    from train.core.run.runlock import RunLock


def execute(p: Prepared, log: Callable[[str], None], *, verbose: bool = False) -> int:
    from launcher.conventions.slurm import earlier_incarnation
    from launcher.running.signals import Forwarder
    from train.core.datasets import tokenscan
    from train.core.run import runlock
    plan, cfg = p.plan, p.cfg
    if _finished_already(p, log):
        return _upload_left_behind(p, log)
    _announce(p, log, verbose=verbose)
    # One job per run directory; a script's launch writes only its logs there.
    lock = runlock.acquire(cfg.run_dir, plan.job, runlock.LeaseTimes.of(cfg), log=log,
                           ended=earlier_incarnation(plan.job)) \
        if plan.program == "train" else None
    if lock is not None:  # the token files' scan, made while validating: workers skip it
        tokenscan.record(cfg.run_dir)
    remote = None
    signals = Forwarder(plan.requeue_signal)
    try:
        remote = _remote_lease(p, log, lock.job) if lock is not None else None
        outcome = _supervise(p, log, lock, signals, verbose=verbose)
    finally:
        if remote is not None:
            remote.release()
        if lock is not None:
            lock.release()
    code = outcome.code
    # after the release: the next incarnation takes the run. (Imported beforehand: after a
    # stop nothing is loaded, on a node whose CPU may be scarce.)
    if signals.requeue_asked and code == EXIT_STOPPED_BY_SIGNAL and plan.requeue:
        requeue(plan.requeue, log)
    elif outcome.unfit_hosts and plan.requeue:
        requeue_without(plan.requeue, outcome.unfit_hosts, log)
    return code


def _remote_lease(p: Prepared, log: Callable[[str], None], job: str):
    """checkpoint.remote: the run's lease in the store too (jobs on different disks),
    for the job that holds the local one."""
    if not p.cfg.checkpoint.remote:
        return None
    from launcher.conventions.slurm import earlier_incarnation
    from train.core.run import runlock
    from train.core.storage import lease as remote_lease
    return remote_lease.acquire(p.cfg.checkpoint.remote, p.cfg.run.name, job,
                                runlock.LeaseTimes.of(p.cfg), log,
                                ended=earlier_incarnation(job))


def _finished_already(p: Prepared, log: Callable[[str], None]) -> bool:
    """A train resuming a run that already reached train.max_steps has nothing to start."""
    from train.core.files import finished_step
    cfg = p.cfg
    if p.request.command != "train" or cfg.checkpoint.resume_from != "auto":
        return False  # resume_from none or a path: train as asked
    done = finished_step(cfg.run_dir, cfg.train.max_steps)
    if done is None:
        return False
    # a late pod of a finished job, or a rerun: nothing to start
    log(f"nothing to do: run {cfg.run.name} finished at step {done} "
        f"({cfg.run_dir / rundir.RESULT}); raise train.max_steps to train on")
    return True


def _upload_left_behind(p: Prepared, log: Callable[[str], None]) -> int:
    """checkpoint.remote: a finished run whose final checkpoint never reached the store
    (its end gave up waiting, exit 7) uploads it now, under the run's lease."""
    if not p.cfg.checkpoint.remote:
        return 0
    import subprocess
    import sys

    from launcher.conventions.slurm import earlier_incarnation
    from train.core.run import runlock
    cfg = p.cfg
    lock = runlock.acquire(cfg.run_dir, p.plan.job, runlock.LeaseTimes.of(cfg), log=log,
                           ended=earlier_incarnation(p.plan.job))
    try:  # its lines on stderr, as the launcher's own
        return subprocess.run([sys.executable, "-m", "train.checkpoint.left_behind",
                               cfg.checkpoint.remote, str(cfg.run_dir), str(cfg.run.name),
                               str(cfg.checkpoint.keep_last), str(cfg.distributed.timeout_s)],
                              env=dict(p.env.raw)).returncode
    finally:
        lock.release()


def _announce(p: Prepared, log: Callable[[str], None], *, verbose: bool) -> None:
    """The plan's notes and warnings, and those of the machine checks (shm, the host's
    name); then the worker variables, one line each with --verbose, else a summary."""
    plan = p.plan
    machine = [f"{f.message}; fix: {f.fix}" for f in p.findings
               if f.level == "warn" and f.topic in ("shm", "network")]
    warnings = [*plan.warnings, *machine]
    for line in [*(f"note: {n}" for n in plan.notes), *(f"warning: {w}" for w in warnings)]:
        log(line)
    if verbose:
        for name, value in plan.env.items():
            log(f"set {name}={value}")
    else:
        log(summarise_env(plan.env))


def _supervise(p: Prepared, log: Callable[[str], None], lock: RunLock | None,
               signals: Forwarder, *, verbose: bool) -> Outcome:
    """Wait for the rendezvous host, then run the plan under :mod:`launcher.running.supervise`
    (:mod:`launcher.running.replica_groups` for replica groups); with the run-directory
    lock (``train``), stop when the lock is lost."""
    from launcher.running import replica_groups, supervise
    from train.core.config import to_yaml
    plan, cfg = p.plan, p.cfg
    if not plan.replica_groups:  # replica groups: each command said as it starts
        log("run " + shlex.join(plan.argv))
    if plan.rdzv_host:
        system.wait_for_host(plan.rdzv_host, p.env.dns_wait_s, log)
    run = replica_groups.run if plan.replica_groups else supervise.run
    return run(plan, p.env.raw, log,
                         keep_fds=(lock.fd,) if lock is not None and lock.fd else (),
                         verbose=verbose,
                         config_text=to_yaml(cfg) if plan.program == "train" else None,
                         abort=(lambda: lock.lost) if lock is not None else None,
                         forwarder=signals)


# What every launch sets (process identity, rendezvous address, Python's own switches):
# counted in the summary line, listed only with --verbose or --dry-run.
PLUMBING = re.compile(r"^((LOCAL_|GROUP_|ROLE_)?(RANK|WORLD_SIZE)|MASTER_(ADDR|PORT)|"
                      r"TORCHELASTIC_.*|PYTHON(PATH|UNBUFFERED|FAULTHANDLER))$")


def summarise_env(values: dict[str, str]) -> str:
    """One plain line for the variables a launch sets: the tuning ones by value, the
    standard ones (process identity, Python's switches) counted."""
    shown = [f"{k}={v}" for k, v in values.items() if not PLUMBING.match(k)]
    rest = len(values) - len(shown)
    if not values:
        return "workers get no extra environment variables"
    standard = (f"{'plus ' if shown else ''}{rest} standard variable{'s' if rest != 1 else ''} "
                "(ranks, addresses, Python's settings)") if rest else ""
    return f"workers get {', '.join([*shown, *([standard] if standard else [])])}; " \
           "--verbose lists them all"
