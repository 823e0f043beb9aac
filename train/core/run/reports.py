"""The records of the launcher <-> worker protocol (:mod:`.protocol`): how a supervised
process ended or how far it got (:class:`Report`, with a :class:`Failure` kept across
restarts and a probe's :class:`Probe`), how torchrun saw each process of a failed attempt
end (:class:`Exit`, :class:`Attempt`), and the one retry rule (:func:`restart_can_help`).
Plain typed data: writing and reading them is :mod:`.protocol`'s.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.core.errors import FINAL_EXIT_CODES

RANK, COMM = "rank", "comm"           # a training worker or script | a doctor --comm probe
TRAINING = "training"                 # a rank's stage while it steps

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


@dataclass(frozen=True)
class Waiting:
    """A training rank waiting for the other ranks in a collective (its hang watchdog saw
    it there, :mod:`train.guards.watchdog`), since ``since`` (this host's wall clock): what
    the launcher publishes for its node so that a partition between nodes is named
    (:mod:`launcher.liveness.partition`)."""
    phase: str                          # "in step 23", "in the checkpoint of step 20", ...
    since: float
    step_s: float | None = None         # the agreed step time (None before the first)


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
    only_local: str | None = None       # finished, the final checkpoint not in the store
    waiting: Waiting | None = None      # in a collective for a while (set while it lasts)
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
        if isinstance(known.get("waiting"), dict):
            known["waiting"] = Waiting(**known["waiting"])
        return cls(**known)
