"""How a launch ended: the user's exit code and one line, from the child's exit status,
the signals that arrived and the workers' reports (:mod:`train.core.reports`).

The first rank to fail is the root cause, except for a hang: a rank that stopped making
progress makes the others time out in a collective, and they often report first. The
reports say which rank did not arrive: the one whose hang watchdog found it in its own
code or in its DataLoader (:mod:`train.watchdog`), or the one whose report stayed at
"training, step N" because it never got to write another (frozen, SIGSTOPped, killed).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from launcher.torchrun import STORE_LOST
from train.core.errors import (
    EXIT_OK,
    EXIT_PEER_STOPPED,
    EXIT_STOPPED_BY_SIGNAL,
    EXIT_STORE_LOST,
    EXIT_TRAINING_FAILED,
    FINAL_EXIT_CODES,
)
from train.core.reports import Report

# Workers that stopped with their checkpoint: told to, or with another node that was.
STOPPED = (EXIT_STOPPED_BY_SIGNAL, EXIT_PEER_STOPPED)


@dataclass(frozen=True)
class Outcome:
    code: int
    message: str | None = None


# gloo's words for a peer that died (its process, or its whole node), both forms.
_PEER = (re.compile(r"\[([^\]]+)\]:(\d+): Connection (?:reset|closed) by peer"),
         re.compile(r"Connection (?:reset|closed) by peer \[([^\]]+)\]:(\d+)"))


def peer_lost(error: str) -> str | None:
    """A short line for "a peer died" errors, which otherwise run to several lines."""
    for pattern in _PEER:
        m = pattern.search(error)
        if m:
            return (f"lost the connection to the worker at {m[1]}:{m[2]} (that worker or "
                    "its node died; its own log says why)")
    return None


def _timed_out(r: Report) -> bool:
    """Did this rank fail waiting for the others (its watchdog found it in a collective,
    or the collective's own timeout fired)?"""
    return r.details.get("hung") == "ranks" or \
        re.search(r"timed? ?out", r.error or "", re.IGNORECASE) is not None


def _log(r: Report) -> str:
    return f"its log {r.log_dir}/stderr.log" if r.log_dir else "its output above"


def hang(failed: list[Report], training: list[Report]) -> str | None:
    """The rank the others waited for, when the reports show one: a rank whose watchdog
    found it in its own code or its DataLoader, or a rank still "training" (it wrote
    nothing more) while the others failed waiting."""
    culprits = [r for r in failed if r.details.get("hung") not in (None, "ranks")]
    if culprits:
        r = culprits[0]
        others = sorted(x.rank for x in failed if x is not r and _timed_out(x))
        waited = f"; rank(s) {', '.join(map(str, others))} waited for it" if others else ""
        return (f"error: training failed: rank {r.rank} hung: {r.error}{waited}; every "
                f"thread's stack is in {_log(r)}")
    waiting = [r for r in failed if _timed_out(r)]
    if waiting and training:
        r = min(training, key=lambda x: (x.details.get("step", 0), x.rank))
        w = waiting[0]
        return (f"error: training failed: rank {r.rank} stopped making progress (its last "
                f"progress report: step {r.details.get('step', 0)}) and wrote nothing more "
                f"(frozen, stopped or killed; see {_log(r)}); rank {w.rank} timed out "
                f"waiting for it: {w.error}")
    return None


def repeated(r: Report) -> str:
    """The failure that came back in two attempts in a row, worded as it first was."""
    d = r.details
    rank = d.get("rank", r.rank)
    what = f" hung: {r.error}" if d.get("hung") not in (None, "ranks") else f": {r.error}"
    log = f"its log {d['log_dir']}/stderr.log" if d.get("log_dir") else _log(r)
    return f"error: training failed: rank {rank}{what}; details in {log}"


def classify(rc: int, found: list[Report], signals: list[int], expected: int,
             mode: str, program: str = "train") -> Outcome:
    """Map the child's exit status and the workers' reports to the user's exit code.
    program: "train" (workers checkpoint on a signal) or "script" (``launch``)."""
    training = [r for r in found if r.exit_code is None]  # last seen training, no end
    found = [r for r in found if r.exit_code is not None]  # how workers ended
    failed = [r for r in found if r.exit_code not in (EXIT_OK, *STOPPED)]
    # The first to fail is the root cause; the others usually fail because it vanished.
    failed.sort(key=lambda r: (r.time, r.rank))
    if failed:
        r = failed[0]
        if r.exit_code in FINAL_EXIT_CODES:  # the worker's own one-line message says it all
            if mode == "direct":
                return Outcome(r.exit_code)  # already the last line of its output
            return Outcome(r.exit_code, r.error or f"error: rank {r.rank} exited "
                                                   f"{r.exit_code}; see its output above")
        if r.details.get("repeated"):  # ended at once: name the rank of the first attempts
            return Outcome(EXIT_TRAINING_FAILED, repeated(r))
        named = hang(failed, training)
        if named:
            return Outcome(EXIT_TRAINING_FAILED, named)
        code = EXIT_TRAINING_FAILED
        where = _log(r)
        what = peer_lost(r.error or "") or r.error or f"exit code {r.exit_code}"
        more = f" ({len(failed) - 1} more rank(s) failed)" if len(failed) > 1 else ""
        failed_text = "training failed" if program == "train" else "the script failed"
        return Outcome(code, f"error: {failed_text}: rank {r.rank}: {what}{more}; "
                             f"details in {where}")
    stopped = [r for r in found if r.exit_code in STOPPED]
    if mode == "torchrun" and rc == STORE_LOST and not signals:
        return Outcome(EXIT_STORE_LOST, "error: torchrun lost its rendezvous store and stopped "
                                        f"the workers ({len(stopped)} of {expected} confirmed "
                                        "their checkpoint); rerun to resume")
    if signals or stopped:
        if rc == 0 and not stopped and len(found) >= expected:
            return Outcome(EXIT_OK)  # the signal came as the last step finished
        name = signal.Signals(signals[0]).name if signals else (
            "another node's stop (its workers got a signal)"
            if all(r.exit_code == EXIT_PEER_STOPPED for r in stopped) else
            "a signal to a worker")
        if program == "script":
            return Outcome(EXIT_STOPPED_BY_SIGNAL, f"stopped by {name} (forwarded to the "
                                                   "script's processes)")
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
        if training:
            step = max(r.details.get("step", 0) for r in training)
            why = f" while training (after step {step})"
        else:
            why = "" if found else " before any worker reported (startup or rendezvous failure)"
        hint = ("something outside killed it: out of memory (the kernel's OOM killer: "
                "dmesg, kubectl describe pod) or a kill -9" if rc == -signal.SIGKILL else
                "a worker killed without a report is often out of memory (dmesg, kubectl "
                "describe pod)")
        return Outcome(EXIT_TRAINING_FAILED,
                       f"error: training failed: {who} {how}{why}; {hint}; see the log above")
    missing = max(0, expected - len(found))
    return Outcome(EXIT_TRAINING_FAILED,
                   f"error: training failed: {missing} local worker(s) ended without a report "
                   f"(killed, e.g. out of memory) and torchrun exited with code {rc}; see the "
                   "log above")


