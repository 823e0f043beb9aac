"""A step's cross-group all-reduce given up as soon as the Lighthouse shows it cannot end.

A killed group's connections close and the all-reduce fails at once; a frozen group
(SIGSTOP, a node stalled) or one cut off from the others (a link down, no FIN, no RST)
closes nothing, and gloo waits out its whole timeout, ``distributed.replica_timeout_s``
(60 s by default): too long to cost at every freeze, too short to shorten, since it
also bounds how far the groups' step times may drift apart. The Lighthouse knows sooner:
every group's Manager beats to it ten times a second, from a thread of its own, so a
group whose beats stopped for longer than the Lighthouse's own heartbeat timeout is
frozen or cut off, and the Lighthouse leaves it out of the next quorum anyway.

So while a step's all-reduce is slow, each rank reads the Lighthouse's status page
(its heartbeats and its current quorum) a few times a second, and gives the step up
when:

- a group of this step's quorum has not beaten for longer than the heartbeat timeout
  (the survivors of a freeze or a cut: about 2 s after it, instead of 60); or
- the Lighthouse has formed a newer quorum (the others gave this step up: a group that
  was frozen and thawed, or cut off and back, learns it at once instead of after its own
  timeout).

Giving up reports the error to the Manager: the step is not committed, and the next
quorum trains it again without the lost group. Only the in-process gloo all-reduce is
given up this way (its wait cannot be cut short, so it is left to end on its own); on
NCCL the timeout stays the bound. The page is torchft's (the version the project
locks); if it cannot be read or parsed, the all-reduce's own timeout applies as before.
"""

from __future__ import annotations

import re
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

# the Rust Duration's debug text on the status page: "1.203767191s", "2.99ms", "12µs"
_SEEN = re.compile(r"^\s*(\S+): seen ([\d.]+)(ns|µs|us|ms|s) ago\s*$", re.M)
_UNIT = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_QUORUM_ID = re.compile(r"Current quorum_id: (\d+)")

FIRST_LOOK_S = 0.5   # an all-reduce that ends sooner is never looked at
LOOK_EVERY_S = 0.25  # then the page is read this often


@dataclass(frozen=True)
class Status:
    """What the Lighthouse's status page says."""
    quorum_id: int
    seen_s: dict[str, float]  # replica id -> seconds since its last heartbeat


def parse(page: str) -> Status | None:
    """The page's current quorum id and heartbeats; None if it has no quorum id."""
    found = _QUORUM_ID.search(page)
    if found is None:
        return None
    seen = {m[1]: float(m[2]) * _UNIT[m[3]] for m in _SEEN.finditer(page)}
    return Status(int(found[1]), seen)


def read_status(lighthouse: str, timeout_s: float = 1.0) -> Status | None:
    """The status of the Lighthouse at ``lighthouse`` (``http://HOST:PORT``); None when
    it does not answer (cut off from it: the all-reduce's timeout decides)."""
    try:
        with urllib.request.urlopen(f"{lighthouse.rstrip('/')}/status",
                                    timeout=timeout_s) as page:
            return parse(page.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None


def why_lost(status: Status, members: list[str], me: str, quorum_id: int,
             stale_s: float) -> str | None:
    """Why this step's all-reduce cannot end, from ``status``: a member of the step's
    quorum (``members``, replica ids ``group_G:<uuid>``; ``me`` this group's
    ``group_G``) silent for longer than ``stale_s``, or a quorum newer than the step's
    (``quorum_id``). None: wait on."""
    if quorum_id >= 0 and status.quorum_id != quorum_id:
        return (f"the Lighthouse formed quorum {status.quorum_id} while this group was in a "
                f"step of quorum {quorum_id}: the other groups went on without it")
    for member in members:
        if member.split(":", 1)[0] == me:
            continue
        silent = status.seen_s.get(member)
        if silent is None or silent > stale_s:
            since = "no heartbeat" if silent is None else f"no heartbeat for {silent:.1f} s"
            return (f"replica group {group_of(member)} in this step's all-reduce is frozen "
                    f"or cut off ({since} at the Lighthouse)")
    return None


def group_of(replica_id: str) -> str:
    """The group number in a replica id (``group_G:<uuid>``)."""
    found = re.match(r"group_(\d+)", replica_id)
    return found[1] if found else replica_id


def wait_or_lost(done: threading.Event, look: Callable[[], str | None]) -> str | None:
    """Wait for ``done``; after FIRST_LOOK_S, ask ``look`` every LOOK_EVERY_S whether the
    wait can still end. Returns ``look``'s reason when it cannot, None once done."""
    if done.wait(FIRST_LOOK_S):
        return None
    while not done.wait(LOOK_EVERY_S):
        reason = look()
        if reason is not None:
            return reason
    return None
