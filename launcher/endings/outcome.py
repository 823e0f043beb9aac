"""How a launch ended: the user's exit code and one line. Every ending read from the
workers' reports is worded here, nowhere else (those the supervisor decides itself:
:mod:`launcher.endings.verdicts`).

:func:`classify` reads the child's exit status, the signals that arrived and the
workers' reports (:mod:`train.core.run.protocol`) as an :class:`Ending`, and takes the first
rule of :data:`RULES` whose condition holds: an ordered table, as torchx maps scheduler
states, so that which ending wins over which is read from top to bottom.

The first rank to fail is the root cause. A rank killed by a signal (out of memory, kill
-9) or crashed in native code writes no report; torchrun's record of the attempt
(:class:`~train.core.run.protocol.Attempt`) says how it ended and that it ended before
torchrun stopped the others: it is named, not the ranks that then failed on the
connection it closed. Except for a hang: a rank that stopped making
progress makes the others time out in a collective, and they often report first. The
reports say which rank did not arrive: the one whose hang watchdog found it in its own
code or in its DataLoader (:mod:`train.guards.watchdog`), or the one whose report stayed at
"training, step N" because it never got to write another (frozen, SIGSTOPped, killed).

The endings the supervisor decides itself (a lost lease, a static job's vanished node,
a rendezvous store that did not come back) are worded in :mod:`launcher.endings.verdicts`.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass

from launcher.running.agent_contract import STORE_LOST
from train.core.errors import (
    EXIT_OK,
    EXIT_ONLY_LOCAL,
    EXIT_PEER_STOPPED,
    EXIT_STOPPED_BY_SIGNAL,
    EXIT_STORE_LOST,
    EXIT_TRAINING_FAILED,
)
from train.core.run.peers import lost_peer
from train.core.run.protocol import Exit, Report, restart_can_help

# Workers that stopped with their checkpoint: told to, or with another node that was.
STOPPED = (EXIT_STOPPED_BY_SIGNAL, EXIT_PEER_STOPPED)


@dataclass(frozen=True)
class Outcome:
    code: int
    message: str | None = None
    unfit_hosts: tuple[str, ...] = ()   # nodes a check found unfit (preflight: fail)


@dataclass(frozen=True)
class Ending:
    """What the launcher knows when its child (torchrun, or the worker) has exited."""
    rc: int                     # the child's exit status (negative: killed by a signal)
    ended: list[Report]         # reports of workers that ended (an exit code)
    training: list[Report]      # reports of workers last seen training (no end written)
    signals: list[int]          # signals the launcher received
    expected: int               # local workers
    mode: str                   # direct | torchrun
    program: str                # train | script (launch)
    exits: list[Exit]           # how torchrun saw the attempt's failed processes end
    host: str | None = None     # this node's name, in a job of several nodes

    @classmethod
    def of(cls, rc: int, found: list[Report], signals: list[int], expected: int, mode: str,
           program: str, exits: list[Exit] = (), host: str | None = None) -> Ending:
        return cls(rc, [r for r in found if r.exit_code is not None],
                   [r for r in found if r.exit_code is None], list(signals), expected, mode,
                   program, list(exits), host)

    @property
    def only_local(self) -> str | None:
        """The line of a worker whose final checkpoint did not reach the store in time."""
        return next((r.only_local for r in self.ended if r.only_local), None)

    @property
    def failed(self) -> list[Report]:
        """Workers that failed, the first to fail first: usually the root cause, the
        others failing because it vanished."""
        failed = [r for r in self.ended if r.exit_code not in (EXIT_OK, *STOPPED)]
        return sorted(failed, key=lambda r: (r.time, r.rank))

    @property
    def first_failure(self) -> Report | None:
        failed = self.failed
        return failed[0] if failed else None

    @property
    def stopped(self) -> list[Report]:
        return [r for r in self.ended if r.exit_code in STOPPED]

    @property
    def died(self) -> list[Exit]:
        """Workers that ended without a word of their own (a signal, or an exit code and no
        report) before torchrun stopped the others: the root cause, whatever the others
        reported after losing them. torchrun's own stop (SIGTERM) of the rest is not a
        death; on a torch that does not say which ended first, SIGTERM is taken for it."""
        said = {r.rank for r in self.ended}
        return sorted((x for x in self.exits if x.code != 0 and x.rank not in said and
                       (x.first or (x.first is None and x.code != -signal.SIGTERM))),
                      key=lambda x: x.rank)


def _log(r: Report) -> str:
    return f"its log {r.log_dir}/stderr.log" if r.log_dir else "its output above"


def _details(r: Report) -> str:
    """Where a failed rank's error is: the file it kept it in, off the console
    (:mod:`train.core.run.failure_log`), else its log."""
    return f"its log {r.details}" if r.details else _log(r)


# What a signal that ended a worker usually means.
_SIGNAL_HINTS = {
    signal.SIGKILL: "often out of memory: dmesg, kubectl describe pod; or a kill -9",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGABRT: "aborted in native code",
    signal.SIGBUS: "often /dev/shm too small",
}


def ended_without_a_word(x: Exit, host: str | None = None) -> str:
    """``rank 1 killed by SIGKILL (often out of memory: ...)``; ``host``: the node, named
    in a job of several."""
    who = f"rank {x.rank}" + (f" on {host}" if host else "")
    if x.code > 0:
        return (f"{who} exited with code {x.code} without a report of its own (a crash in "
                "native code, or os._exit)")
    try:
        name = signal.Signals(-x.code).name
    except ValueError:
        name = f"signal {-x.code}"
    hint = _SIGNAL_HINTS.get(-x.code)
    return f"{who} killed by {name}" + (f" ({hint})" if hint else "")


# ------------------------------------------------------------------ the rules' words

def _final(e: Ending) -> Outcome:
    """Bad input, a machine that cannot run it, divergence: the worker's own one-line
    message says it all (in direct mode it is already the last line of the output)."""
    r = e.first_failure
    unfit = tuple(r.unfit_hosts or ())
    if e.mode == "direct":
        return Outcome(r.exit_code, unfit_hosts=unfit)
    if not r.details:  # the rank said it on the console itself (no log folder)
        return Outcome(r.exit_code, r.error or f"error: rank {r.rank} exited {r.exit_code}; "
                                               "see its output above", unfit)
    return Outcome(r.exit_code, f"{r.error or f'error: exit {r.exit_code}'} (rank {r.rank} "
                                f"failed first; details in {_details(r)})", unfit)


def _repeated(e: Ending) -> Outcome:
    """Ended at once: the failure that came back in two attempts in a row, worded as it
    first was, naming the rank of the first attempts."""
    r = e.first_failure
    first = r.repeated
    what = f" hung: {r.error}" if first.culprit else f": {r.error}"
    log = f"its log {first.log_dir}/stderr.log" if first.log_dir else _log(r)
    return Outcome(EXIT_TRAINING_FAILED,
                   f"error: training failed: rank {first.rank}{what}; details in {log}")


def _hung_rank(e: Ending) -> str | None:
    """A rank whose watchdog found it in its own code or its DataLoader."""
    culprits = [r for r in e.failed if r.culprit]
    if not culprits:
        return None
    r = culprits[0]
    others = sorted(x.rank for x in e.failed if x is not r and x.waited_for_others)
    waited = f"; rank(s) {', '.join(map(str, others))} waited for it" if others else ""
    return (f"error: training failed: rank {r.rank} hung: {r.error}{waited}; every thread's "
            f"stack is in {_log(r)}")


def _silent_rank(e: Ending) -> str | None:
    """A rank still "training" (it wrote nothing more) while the others failed waiting."""
    waiting = [r for r in e.failed if r.waited_for_others]
    if not (waiting and e.training):
        return None
    r = min(e.training, key=lambda x: (x.step or 0, x.rank))
    return (f"error: training failed: rank {r.rank} stopped making progress (its last "
            f"progress report: step {r.step or 0}) and wrote nothing more (frozen, stopped "
            f"or killed; see {_log(r)}); rank {waiting[0].rank} timed out waiting for it: "
            f"{waiting[0].error}")


def hang(e: Ending) -> str | None:
    """The rank the others waited for, when the reports show one."""
    return _hung_rank(e) or _silent_rank(e)


def _failed_text(e: Ending) -> str:
    return "training failed" if e.program == "train" else "the script failed"


def _failed(e: Ending) -> Outcome:
    r, failed = e.first_failure, e.failed
    more = f" ({len(failed) - 1} more rank(s) failed)" if len(failed) > 1 else ""
    lost = lost_peer(r.error or "")
    if lost:  # the one that died is elsewhere (another node): this rank only survived it
        return Outcome(EXIT_TRAINING_FAILED,
                       f"error: {_failed_text(e)}: a worker died, or its node did: rank "
                       f"{r.rank} {lost}{more}; that worker's own log says why (rank "
                       f"{r.rank}'s: {_details(r)})")
    what = r.error or f"exit code {r.exit_code}"
    return Outcome(EXIT_TRAINING_FAILED, f"error: {_failed_text(e)}: rank {r.rank}: {what}"
                                         f"{more}; details in {_details(r)}")


def _died_log(e: Ending, x: Exit) -> str:
    if x.log_dir:
        return f"its log {x.log_dir}/stderr.log"
    mine = next((r for r in e.training if r.rank == x.rank and r.log_dir), None)
    return _log(mine) if mine else "the log above"


def _died_first(e: Ending) -> Outcome:
    """A worker ended without a word (killed, crashed) before torchrun stopped the rest:
    it is named, not the ranks that then lost their connection to it."""
    x, *others = e.died
    too = f" (rank(s) {', '.join(str(o.rank) for o in others)} too)" if others else ""
    after = len(e.failed)
    more = f"; {after} more rank(s) failed after it" if after else ""
    return Outcome(EXIT_TRAINING_FAILED,
                   f"error: {_failed_text(e)}: {ended_without_a_word(x, e.host)}{too}{more}; "
                   f"details in {_died_log(e, x)}")


def _store_lost(e: Ending) -> Outcome:
    return Outcome(EXIT_STORE_LOST, "error: torchrun lost its rendezvous store and stopped "
                                    f"the workers ({len(e.stopped)} of {e.expected} confirmed "
                                    "their checkpoint); rerun to resume")


def _stopped(e: Ending) -> Outcome:
    name = signal.Signals(e.signals[0]).name if e.signals else (
        "another node's stop (its workers got a signal)"
        if all(r.exit_code == EXIT_PEER_STOPPED for r in e.stopped) else "a signal to a worker")
    if e.program == "script":
        return Outcome(EXIT_STOPPED_BY_SIGNAL, f"stopped by {name} (forwarded to the script's "
                                               "processes)")
    unsure = "" if len(e.stopped) >= e.expected else \
        f" ({len(e.stopped)} of {e.expected} local worker(s) confirmed their checkpoint)"
    return Outcome(EXIT_STOPPED_BY_SIGNAL, f"stopped by {name}{unsure}; rerun the same "
                                           "command to resume from the last checkpoint")


def _died(e: Ending) -> Outcome:
    """The child killed, or ended before any worker reported."""
    how = (f"was killed by {signal.Signals(-e.rc).name}" if e.rc < 0
           else f"exited with code {e.rc}")
    who = "the worker" if e.mode == "direct" else "torchrun"
    if e.training:
        # a rank's report is at most about a second old (train.guards.watchdog
        # PROGRESS_EVERY_S): short steps go on past the step it names
        why = (f" while training (at step {max(r.step or 0 for r in e.training)} or later: "
               "ranks report their step about once a second)")
    else:
        why = "" if e.ended else " before any worker reported (startup or rendezvous failure)"
    hint = ("something outside killed it: out of memory (the kernel's OOM killer: dmesg, "
            "kubectl describe pod) or a kill -9" if e.rc == -signal.SIGKILL else
            "a worker killed without a report is often out of memory (dmesg, kubectl "
            "describe pod)")
    return Outcome(EXIT_TRAINING_FAILED,
                   f"error: training failed: {who} {how}{why}; {hint}; see the log above")


def _missing(e: Ending) -> Outcome:
    missing = max(0, e.expected - len(e.ended))
    return Outcome(EXIT_TRAINING_FAILED,
                   f"error: training failed: {missing} local worker(s) ended without a report "
                   f"(killed, e.g. out of memory) and torchrun exited with code {e.rc}; see "
                   "the log above")


# --------------------------------------------------------------------------- rules

@dataclass(frozen=True)
class Rule:
    name: str
    when: Callable[[Ending], bool]
    then: Callable[[Ending], Outcome]


def _first_failure_is(test: Callable[[Report], bool]) -> Callable[[Ending], bool]:
    return lambda e: e.first_failure is not None and test(e.first_failure)


RULES: tuple[Rule, ...] = (
    # A worker failed: the first failure decides, unless a hang explains it.
    Rule("final", _first_failure_is(lambda r: not restart_can_help(r.exit_code)), _final),
    Rule("repeated", _first_failure_is(lambda r: r.repeated is not None), _repeated),
    # A worker that died without a word is the cause of the others' failures.
    Rule("died first", lambda e: bool(e.died), _died_first),
    Rule("hang", lambda e: e.first_failure is not None and hang(e) is not None,
         lambda e: Outcome(EXIT_TRAINING_FAILED, hang(e))),
    Rule("failed", lambda e: e.first_failure is not None, _failed),
    # No worker failed.
    Rule("store lost", lambda e: e.mode == "torchrun" and e.rc == STORE_LOST and not e.signals,
         _store_lost),
    # Finished, but the final checkpoint is only on this disk: a retry uploads it.
    Rule("only local", lambda e: e.rc == 0 and e.only_local is not None,
         lambda e: Outcome(EXIT_ONLY_LOCAL, e.only_local)),
    Rule("signal after the last step", lambda e: bool(e.signals) and e.rc == 0 and
         not e.stopped and len(e.ended) >= e.expected, lambda e: Outcome(EXIT_OK)),
    Rule("stopped", lambda e: bool(e.signals or e.stopped), _stopped),
    Rule("done", lambda e: e.rc == 0, lambda e: Outcome(EXIT_OK)),
    Rule("died", lambda e: e.rc < 0 or not e.ended, _died),
    Rule("reports missing", lambda e: True, _missing),
)


def classify(rc: int, found: list[Report], signals: list[int], expected: int,
             mode: str, program: str = "train", exits: list[Exit] = (),
             host: str | None = None) -> Outcome:
    """Map the child's exit status and the workers' reports to the user's exit code.
    program: "train" (workers checkpoint on a signal) or "script" (``launch``); exits:
    how torchrun saw the last attempt's processes end; host: this node's name, to name
    in a job of several nodes."""
    ending = Ending.of(rc, found, signals, expected, mode, program, exits, host)
    return next(rule.then(ending) for rule in RULES if rule.when(ending))
