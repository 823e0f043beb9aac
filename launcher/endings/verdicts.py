"""The endings the supervisor decides itself, in the words the user reads: a static
job's failed worker or vanished node (a static rendezvous cannot replace a node), a lost
run-directory lease, a rendezvous store that did not come back. The endings read from
the workers' reports are :mod:`launcher.endings.outcome`'s.
"""

from __future__ import annotations

from launcher.endings.outcome import Outcome
from train.core.errors import EXIT_RUN_DIR_BUSY, EXIT_STORE_LOST, EXIT_TRAINING_FAILED


def _static(convention: str) -> str:
    return (f"A static rendezvous ({convention}) cannot replace a node: every node stops; "
            "restart the job (its pods, or resubmit it) and it resumes from the last "
            "checkpoint")


def static_failed(outcome: Outcome, convention: str) -> Outcome:
    """A static job's worker failed: a lost node cannot rejoin, so the job ends."""
    return Outcome(outcome.code, f"{outcome.message}. {_static(convention)}")


def node_lost(lost: str, convention: str) -> Outcome:
    """A static job's node vanished (its heartbeat stopped): every node stops, naming it."""
    return Outcome(EXIT_TRAINING_FAILED, f"error: training failed: {lost}. {_static(convention)}")


def lease_lost(reason: str) -> Outcome:
    return Outcome(EXIT_RUN_DIR_BUSY, f"error: {reason}")


def store_gone(store: str, wait_s: float, lost_times: int | None) -> Outcome:
    """The rendezvous store did not come back within ``wait_s``, or was lost
    ``lost_times`` times (the most the launcher rejoins)."""
    why = (f"did not come back within {wait_s} s (distributed.rdzv_store_wait_s)"
           if lost_times is None else f"was lost {lost_times} times (the most this launcher "
                                      "rejoins)")
    return Outcome(EXIT_STORE_LOST, f"error: the rendezvous store {store} {why}; the workers "
                                    "wrote their checkpoint. Check the rendezvous Deployment "
                                    "and Service, then restart this pod: it resumes from the "
                                    "last checkpoint")


def lighthouse_down(argv: str, why: str, log: str) -> Outcome:
    """torchft's Lighthouse did not come up (replica groups): nothing was started."""
    return Outcome(EXIT_TRAINING_FAILED, f"error: torchft's Lighthouse ({argv}) {why}; no "
                                         f"replica group was started; its log: {log}")


def lighthouse_lost(line: str, relaunches: int, pod: bool = False) -> Outcome:
    """The Lighthouse was lost once more than ``distributed.max_restarts`` allows; ``pod``:
    a pod of Kubernetes' Indexed Job, which its Job recreates (exit 1 counts against
    backoffLimitPerIndex)."""
    then = "the Job recreates this pod, which resumes from the last checkpoint" if pod \
        else "rerun the same command to resume from the last checkpoint"
    return Outcome(EXIT_TRAINING_FAILED, f"error: training failed: {line}, after {relaunches} "
                                         f"relaunch(es) (distributed.max_restarts); {then}")


def lighthouse_lost_on_nodes(line: str) -> Outcome:
    """SLURM's replica groups lost node 0's Lighthouse: each node ends its group, exit 1
    (a retry can fix it: the next incarnation starts it again)."""
    return Outcome(EXIT_TRAINING_FAILED, f"error: training failed: {line}; resubmit the "
                                         "job, or requeue it (scontrol requeue), to resume "
                                         "from the last checkpoint")


def group_ended(group: int, outcome: Outcome, max_restarts: int) -> str:
    """One line for a replica group that ended otherwise than done, from its own outcome."""
    why = (outcome.message or f"exit code {outcome.code}").removeprefix("error: ")
    if outcome.code == EXIT_TRAINING_FAILED:
        return f"replica group {group} gave up after {max_restarts} restart(s): {why}"
    return f"replica group {group} ended with exit code {outcome.code}: {why}"
