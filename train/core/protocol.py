"""The launcher <-> worker protocol: what a supervised process tells the launcher, and
what a restart can fix.

torchrun ends with exit 1 and a traceback both when a worker fails and when it is
stopped by SIGTERM, and a hung process says nothing at all. So each supervised process
(a training worker, a ``launch`` script, a ``doctor --comm`` probe) keeps a
:class:`Report` in the folder the launcher gives it (``TRAIN_LAUNCHER_STATUS_DIR``): how
far it got (the step it reached, the probe's stage) and how it ended (exit code, one-line
error, where its log is). The launcher reads them back to choose the exit code and to
name the failing or silent rank in one line (:mod:`launcher.outcome`).

This module is the protocol's only owner:

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
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.core import rundir
from train.core.errors import EXIT_TRAINING_FAILED, FINAL_EXIT_CODES
from train.core.files import write_json_atomic
from train.core.identity import WorkerIdentity

RANK, COMM = "rank", "comm"           # a training worker or script | a doctor --comm probe
TRAINING = "training"                 # a rank's stage while it steps
# In the launcher's status folder, beside the reports: every failure of the launch, how
# torchrun saw each failed attempt's processes end, and the config as the launch
# validated it (which every worker start reads).
FAILURES = "failures.jsonl"
ATTEMPTS = "attempts.jsonl"
CONFIG_SNAPSHOT = "validated-config.yaml"

# What a hung rank's main thread waited for (train.guards.watchdog): the other ranks (a
# collective), its DataLoader workers, or its own code.
WAITS_FOR_RANKS, WAITS_FOR_LOADER, STUCK_IN_OWN_CODE = "ranks", "loader", "own"


def culprit(hung: str | None) -> bool:
    """Hung in its own code or its DataLoader: the rank the others waited for."""
    return hung not in (None, WAITS_FOR_RANKS)


def restart_can_help(exit_code: int | None, repeated: bool = False) -> bool:
    """The retry rule. A restart cannot change bad input (2), a machine that cannot run
    the job (3) or a divergence (4), nor a failure that came back in two attempts in a row
    from the same checkpoint (``repeated``); every other ending may go otherwise next
    time (a lost node, a store that returns, a busy run directory)."""
    return exit_code not in FINAL_EXIT_CODES and not repeated


@dataclass(frozen=True)
class Failure:
    """One failed attempt of a rank, as :data:`FAILURES` keeps it across restarts (the
    reports themselves are replaced each round)."""
    restart: int
    rank: int
    error: str | None = None
    checkpoint: str | None = None     # the run's newest checkpoint when it failed
    hung: str | None = None           # WAITS_FOR_* / STUCK_IN_OWN_CODE when it hung
    log_dir: str | None = None

    @property
    def culprit(self) -> bool:
        return culprit(self.hung)

    def same_as(self, other: Failure) -> bool:
        """The same failure: the error alike but for numbers that change between attempts
        (ports, addresses, timings), from the same checkpoint."""
        def shape(error: object) -> str:
            return re.sub(r"0x[0-9a-fA-F]+|\d+", "N", str(error))
        return shape(self.error) == shape(other.error) and self.checkpoint == other.checkpoint


@dataclass(frozen=True)
class Exit:
    """How torchrun saw one local worker process end: the evidence for a rank that died
    without a word (a signal, a crash in native code), and for which ended first."""
    rank: int
    local_rank: int
    code: int                         # the exit status; negative: killed by that signal
    first: bool | None = None         # ended before torchrun stopped the others (None: unknown)
    log_dir: str | None = None        # torchrun's log folder of the process


@dataclass(frozen=True)
class Attempt:
    """A failed attempt of torchrun's local workers (:data:`ATTEMPTS`, written by
    :mod:`launcher.torchrun`), and whether torchrun starts them again."""
    restart: int                      # the attempt's restart round (its workers' count)
    exits: list[Exit]
    host: str
    max_restarts: int = 0
    restarting: bool = False          # torchrun starts restart + 1 of max_restarts

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attempt:
        return cls(**{**data, "exits": [Exit(**x) for x in data.get("exits", [])]})


@dataclass(frozen=True)
class Probe:
    """What a ``doctor --comm`` process measured: the preflight check's matmul and
    all-reduce (:mod:`train.guards.preflight`), and where it ran."""
    world_size: int | None = None
    ok: bool | None = None             # every all-reduce summed right
    seconds: float | None = None       # the median all-reduce
    bytes: int | None = None
    bus_gb_s: float | None = None
    gflops: float | None = None        # the matmul's median repetition
    nonfinite: str | None = None       # "NaN" or "inf" in the matmul's result
    host: str | None = None
    node: int | None = None
    check_s: float | None = None       # the whole check


@dataclass
class Report:
    rank: int
    kind: str = RANK
    local_rank: int = 0
    restart: int = 0                    # torchrun's restart round
    exit_code: int | None = None        # how it ended; None while it runs
    error: str | None = None            # one line
    log_dir: str | None = None          # where the rank's full log is
    details: str | None = None          # its failure's file, kept off the console
    stage: str | None = None            # training | comm: start, init, allreduce, done, error
    step: int | None = None             # the last step a training rank reached
    hung: str | None = None             # set by the hang watchdog: what it waited for
    repeated: Failure | None = None     # ended at once: the earlier failure that came back
    probe: Probe | None = None          # comm: the all-reduce's result
    checkpoint: str | None = None       # the run's newest checkpoint when it ended
    unfit_hosts: list[str] | None = None  # hosts a check found unfit (preflight: fail)
    pid: int = field(default_factory=os.getpid)
    time: float = field(default_factory=time.time)

    @property
    def final(self) -> bool:
        """Ended in a way a restart cannot change."""
        return self.exit_code is not None and not restart_can_help(
            self.exit_code, self.repeated is not None)

    @property
    def culprit(self) -> bool:
        return culprit(self.hung)

    @property
    def waited_for_others(self) -> bool:
        """Failed waiting for the other ranks: its watchdog found it in a collective, or
        the collective's own timeout fired."""
        return self.hung == WAITS_FOR_RANKS or \
            re.search(r"timed? ?out", self.error or "", re.IGNORECASE) is not None

    def as_failure(self) -> Failure:
        return Failure(self.restart, self.rank, self.error, self.checkpoint, self.hung,
                       self.log_dir)

    def path_in(self, folder: str | Path) -> Path:
        """One file per local process: a rendezvous round after a membership change
        renumbers the ranks (without a restart count), and every local worker of the
        new round replaces the file of its local rank, so no report of an earlier
        round survives as if it were this one's."""
        slot = self.local_rank if self.kind == RANK else self.rank
        return Path(folder) / f"{self.kind}-{slot}.json"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        if isinstance(known.get("repeated"), dict):
            known["repeated"] = Failure(**known["repeated"])
        if isinstance(known.get("probe"), dict):
            known["probe"] = Probe(**known["probe"])
        return cls(**known)


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
        self.details: str | None = None  # where its failure went (train.core.failure_log)

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
                             unfit_hosts=self.unfit_hosts, details=self.details)
        write(self.folder, report)
        if exit_code == EXIT_TRAINING_FAILED and repeated is None:
            record_failure(self.folder, report)
        return report

    def hung(self, step: int, waits: str, error: str) -> None:
        """The hang watchdog's verdict, kept like any failure: a hang that recurs from the
        same checkpoint is not restarted again and again."""
        report = self.report(exit_code=EXIT_TRAINING_FAILED, error=error, stage=TRAINING,
                             step=step, hung=waits, checkpoint=self.newest_checkpoint())
        write(self.folder, report)
        record_failure(self.folder, report)

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
