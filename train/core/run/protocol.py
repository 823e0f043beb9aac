"""The launcher <-> worker protocol: what a supervised process tells the launcher, and
what a restart can fix.

torchrun ends with exit 1 and a traceback both when a worker fails and when it is
stopped by SIGTERM, and a hung process says nothing at all. So each supervised process
(a training worker, a ``launch`` script, a ``doctor --comm`` probe) keeps a
:class:`Report` in the folder the launcher gives it (``TRAIN_LAUNCHER_STATUS_DIR``): how
far it got (the step it reached, the probe's stage) and how it ended (exit code, one-line
error, where its log is). The launcher reads them back to choose the exit code and to
name the failing or silent rank in one line (:mod:`launcher.endings.outcome`).

This module (with its records, :mod:`.reports`) is the protocol's only owner:

- :class:`Report` and its parts (:class:`Failure`, :class:`Probe`) are typed records;
  :class:`Reporter` is the one constructor, used by every process that writes one;
- :class:`Attempt` (written by torchrun's agent, :mod:`launcher.torchrun`) records how
  each process of a failed attempt ended, for a process that could not say it (killed
  by a signal);
- :func:`restart_can_help` is the one retry rule (bad input, a machine that cannot run
  it, divergence, and a failure that repeated from the same checkpoint are final),
  used by the worker before it starts, by the supervisor before it restarts, by the
  outcome rules and by the test that holds the Kubernetes Job's podFailurePolicy;
- writing never raises (a report must not turn a result into a crash), reading skips
  what it cannot parse.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

from train.core.errors import EXIT_TRAINING_FAILED
from train.core.files import write_json_atomic
from train.core.run import rundir
from train.core.run.identity import WorkerIdentity
from train.core.run.reports import (  # the records, used by every side under these names
    COMM,
    RANK,
    STUCK_IN_OWN_CODE,
    TRAINING,
    WAITS_FOR_LOADER,
    WAITS_FOR_RANKS,
    Attempt,
    Exit,
    Failure,
    Probe,
    Report,
    Waiting,
    culprit,
    restart_can_help,
)

# In the launcher's status folder, beside the reports: every failure of the launch, how
# torchrun saw each failed attempt's processes end, and the config as the launch
# validated it (which every worker start reads).
FAILURES = "failures.jsonl"
ATTEMPTS = "attempts.jsonl"
CONFIG_SNAPSHOT = "validated-config.yaml"
# The other way, from the launcher to its workers: its verdict on a wait every node of the
# job shares (launcher.liveness.partition), which the waiting ranks' watchdogs end with.
VERDICT = "wait-verdict.json"

__all__ = [
    "ATTEMPTS",
    "COMM",
    "CONFIG_SNAPSHOT",
    "FAILURES",
    "RANK",
    "STUCK_IN_OWN_CODE",
    "TRAINING",
    "VERDICT",
    "WAITS_FOR_LOADER",
    "WAITS_FOR_RANKS",
    "Attempt",
    "Exit",
    "Failure",
    "Probe",
    "Report",
    "Reporter",
    "Waiting",
    "attempts",
    "culprit",
    "failures",
    "last_attempt",
    "latest_round",
    "read_all",
    "record_attempt",
    "record_failure",
    "restart_can_help",
    "write",
    "write_verdict",
]


class Reporter:
    """This process's side of the protocol: the one place a report is built.

    ``checkpoints``: the run's checkpoint folder, once the process knows it (from the
    config it loaded), so that an ending names the checkpoint the run stood at: how a
    restart tells a failure that repeats from one that a restart fixed. ``unfit_hosts``:
    the hosts a check found unfit, for a scheduler that can requeue without them.
    """

    def __init__(self, ident: WorkerIdentity, kind: str = RANK):
        self.ident, self.kind = ident, kind
        self.checkpoints: Path | None = None
        self.unfit_hosts: list[str] | None = None  # set when a check found them
        self.details: str | None = None  # where its failure went (train.core.run.failure_log)
        self.only_local: str | None = None  # the line of a final checkpoint not uploaded
        # The hang watchdog's thread reports waits; once the process said how it ended,
        # none may replace that report.
        self._lock, self._ended = threading.Lock(), False

    @classmethod
    def from_environ(cls, kind: str = RANK) -> Reporter:
        return cls(WorkerIdentity.from_environ(), kind)

    @property
    def folder(self) -> str | None:
        return self.ident.status_dir

    def report(self, **fields: Any) -> Report:
        i = self.ident
        return Report(rank=i.rank, kind=self.kind, local_rank=i.local_rank,
                      restart=i.restart_count, log_dir=i.log_dir, **fields)

    def newest_checkpoint(self) -> str | None:
        return rundir.latest_name(self.checkpoints) if self.checkpoints else None

    def progress(self, step: int) -> None:
        """Still training, at ``step``: what names a rank that froze."""
        write(self.folder, self.report(stage=TRAINING, step=step))

    def ended(self, exit_code: int, error: str | None, repeated: Failure | None = None) -> Report:
        """How this process ended. A failure is also kept (:data:`FAILURES`), unless it is
        an earlier one repeated."""
        report = self.report(exit_code=exit_code, error=error, repeated=repeated,
                             checkpoint=self.newest_checkpoint(),
                             unfit_hosts=self.unfit_hosts, details=self.details,
                             only_local=self.only_local)
        with self._lock:
            self._ended = True
            write(self.folder, report)
        if exit_code == EXIT_TRAINING_FAILED and repeated is None:
            record_failure(self.folder, report)
        return report

    def hung(self, step: int, waits: str, error: str) -> None:
        """The hang watchdog's verdict, kept like any failure: a hang that recurs from the
        same checkpoint is not restarted again and again."""
        report = self.report(exit_code=EXIT_TRAINING_FAILED, error=error, stage=TRAINING,
                             step=step, hung=waits, checkpoint=self.newest_checkpoint())
        with self._lock:
            self._ended = True
            write(self.folder, report)
        record_failure(self.folder, report)

    def waiting(self, step: int, waiting: Waiting | None) -> None:
        """In a collective for a while (the hang watchdog saw it), or no longer (None)."""
        with self._lock:
            if not self._ended:
                write(self.folder, self.report(stage=TRAINING, step=step, waiting=waiting))

    def verdict(self, phase: str) -> str | None:
        """The launcher's line when it judged this attempt's wait ``phase`` (every node's
        ranks waiting there: a partition); None otherwise."""
        if not self.folder:
            return None
        try:
            data = json.loads((Path(self.folder) / VERDICT).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("restart") != self.ident.restart_count or \
                data.get("phase") != phase:
            return None
        line = data.get("line")
        return line if isinstance(line, str) else None

    def stage(self, stage: str, error: str | None = None, probe: Probe | None = None) -> None:
        """A probe's progress (``doctor --comm``)."""
        write(self.folder, self.report(stage=stage, error=error, probe=probe))

    def earlier_final(self) -> Report | None:
        """An earlier round's report of an ending a restart cannot change. torchrun
        restarts workers whatever their exit code; such a restart ends at once with the
        same answer."""
        if self.ident.restart_count == 0 or not self.folder:
            return None
        return next((r for r in read_all(self.folder)
                     if r.restart < self.ident.restart_count and r.final), None)

    def repeated_failure(self) -> Failure | None:
        """The failure of the last attempt when the attempt before it failed the same way
        (the same error, from the same newest checkpoint): a restart cannot fix it. A rank
        that hung comes first: the others failed waiting for it."""
        restart = self.ident.restart_count
        if restart < 2 or not self.folder:
            return None
        seen = failures(self.folder)
        last = [f for f in seen if f.restart == restart - 1]
        before = [f for f in seen if f.restart == restart - 2]
        again = [f for f in last if any(f.same_as(g) for g in before)]
        again.sort(key=lambda f: not f.culprit)
        return again[0] if again else None


def write(folder: str | Path | None, report: Report) -> None:
    """Replace this process's report (atomically; a reader never sees half of one)."""
    if not folder:
        return
    if report.error:
        report.error = " ".join(report.error.split())[:500]
    try:
        write_json_atomic(report.path_in(folder), dataclasses.asdict(report), durable=False)
    except OSError:
        pass  # reporting must never turn a result into a crash


def write_verdict(folder: str | Path | None, restart: int, phase: str, line: str) -> None:
    """The launcher's verdict on its workers' wait ``phase`` in attempt ``restart``: each
    rank still waiting there ends as hung with ``line`` (:meth:`Reporter.verdict`)."""
    if not folder:
        return
    try:
        write_json_atomic(Path(folder) / VERDICT,
                          {"restart": restart, "phase": phase, "line": line}, durable=False)
    except OSError:
        pass  # the hang watchdog's own limit still ends the wait


def record_failure(folder: str | Path | None, report: Report) -> None:
    _append(folder, FAILURES, json.dumps(dataclasses.asdict(report.as_failure())))


def _append(folder: str | Path | None, name: str, line: str) -> None:
    if not folder:
        return
    try:
        with open(Path(folder) / name, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        pass  # reporting must never turn a result into a crash


def _read_lines(folder: str | Path, name: str, parse):
    try:
        lines = (Path(folder) / name).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(parse(json.loads(line)))
        except (ValueError, TypeError, AttributeError):
            continue
    return out


def record_attempt(folder: str | Path | None, attempt: Attempt) -> None:
    _append(folder, ATTEMPTS, json.dumps(dataclasses.asdict(attempt)))


def attempts(folder: str | Path) -> list[Attempt]:
    return _read_lines(folder, ATTEMPTS, Attempt.from_dict)  # oldest first


def last_attempt(folder: str | Path, reports: list[Report]) -> Attempt | None:
    """The recorded ending of the attempt ``reports`` (the latest round) belong to."""
    found = attempts(folder)
    latest = max((r.restart for r in reports), default=0)
    return found[-1] if found and found[-1].restart >= latest else None


def failures(folder: str | Path) -> list[Failure]:
    return _read_lines(folder, FAILURES, lambda data: Failure(**data))


def read_all(folder: str | Path, kind: str = RANK) -> list[Report]:
    """Every readable report of ``kind`` in ``folder``, sorted by rank."""
    out = []
    for path in Path(folder).glob(f"{kind}-*.json"):
        try:
            out.append(Report.from_dict(json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(out, key=lambda r: r.rank)


def latest_round(reports: list[Report]) -> list[Report]:
    """Elastic restarts renumber ranks: keep only the last restart round's reports."""
    last = max((r.restart for r in reports), default=0)
    return [r for r in reports if r.restart == last]
