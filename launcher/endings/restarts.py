"""A failed attempt of the workers, said in one line when it is started again: by
torchrun's agent (:mod:`launcher.torchrun`) for its workers, by the supervisor
(:mod:`launcher.running.supervise`) for the one worker it runs itself. Worded with the same
rules as the final failure line (:mod:`launcher.endings.outcome`): a worker that died without a
word is named, not the ranks that lost their connection to it. Workers the launcher
itself killed (a node left the job) are said as such (:func:`note_stop`), not as deaths.
"""

from __future__ import annotations

import time
from pathlib import Path

from launcher.endings.outcome import Ending, ended_without_a_word
from train.core.run.peers import lost_peer
from train.core.run.protocol import Exit, Report


def cause(e: Ending) -> str:
    """What ended an attempt, in a few words, for the line that says it is restarted."""
    if e.died:
        x, *others = e.died
        too = f" (rank(s) {', '.join(str(o.rank) for o in others)} too)" if others else ""
        return ended_without_a_word(x, e.host) + too
    r = e.first_failure
    if r is None:
        return "a worker ended" + (f" (exit code {e.rc})" if e.rc else "")
    if r.culprit:
        return f"rank {r.rank} hung: {r.error}"
    return f"rank {r.rank} failed: {lost_peer(r.error or '') or r.error or r.exit_code}"


def failed_attempt(found: list[Report], exits: list[Exit], expected: int,
                   host: str | None = None) -> tuple[str, bool]:
    """(what ended a failed attempt of the workers; whether a restart cannot change it:
    bad input, a machine that cannot run it, divergence, a failure that repeated)."""
    e = Ending.of(1, found, [], expected, "torchrun", "train", exits, host)
    first = e.first_failure
    return cause(e), not e.died and first is not None and first.final


def attempt_verdict(found: list[Report], exits: list[Exit], expected: int, host: str | None,
                    stopped: str | None) -> tuple[str, bool, bool]:
    """(what ended a failed attempt; whether a restart cannot change it; whether the
    launcher's own stop of the workers explains it). ``stopped``: the launcher's note
    that it killed this node's workers (a peer node left). A worker's own final verdict
    (bad input, a machine that cannot run the job) stands even then: the peer that left
    has usually ended for the same reason (every node checks alike), and a restart would
    wait for it in vain."""
    what, final = failed_attempt(found, exits, expected, host)
    if stopped and not final:
        return f"{stopped}: the launcher stopped this node's workers", False, True
    return what, final, False


def restarting(what: str, number: int, of: int, workers: str = "workers") -> str:
    """The one line that says a failed attempt is started again."""
    return f"{what}; restarting the {workers} ({number} of {of})"


# In the status folder: why the launcher itself killed this node's workers, until
# torchrun's agent has said it.
STOPPED_BY_LAUNCHER = "stopped-by-launcher.txt"


# A note older than this was not about the failure torchrun is handling now (the
# workers had ended on their own before the launcher's kill reached them).
NOTE_FRESH_S = 30.0


def note_stop(folder: str | None, why: str) -> None:
    """The launcher is about to kill the workers (SIGKILL, on purpose): the restart line
    says why, not "killed by SIGKILL (often out of memory)"."""
    if folder:
        try:
            (Path(folder) / STOPPED_BY_LAUNCHER).write_text(f"{time.time()}\t{why}",
                                                            encoding="utf-8")
        except OSError:
            pass


def take_stop_note(folder: str | None) -> str | None:
    """The launcher's reason, once and while fresh (later failures are their own)."""
    if not folder:
        return None
    path = Path(folder) / STOPPED_BY_LAUNCHER
    try:
        when, _, why = path.read_text(encoding="utf-8").partition("\t")
        path.unlink()
        fresh = time.time() - float(when) < NOTE_FRESH_S
    except (OSError, ValueError):
        return None
    return why if fresh else None
