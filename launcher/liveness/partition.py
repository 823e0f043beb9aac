"""Naming a partition between the nodes of an elastic job within a minute.

Two nodes that lose each other while both still reach the rendezvous store change
nothing the store sees: their keep-alives go on, their pulses answer. Their ranks wait
for each other in a collective until its timeout (``distributed.timeout_s``, 600 s), and
each rank's hang watchdog speaks at 120 s at the earliest. What does show it: *every*
node's ranks wait for the others, in the same step (or the same checkpoint), and none
computes. A wait that no rank of the job computes through cannot end by itself.

So, while an elastic job of two or more nodes trains:

- each rank's hang watchdog reports a wait in a collective that lasts (its phase, since
  when, the agreed step time: :class:`train.core.run.protocol.Waiting`);
- each node's launcher (:class:`PartitionWatch`, run by the round watcher at each look)
  reads its local ranks' reports; once *all* of them have waited in the same phase past
  :func:`bound_s` (3 step times, at least 30 s, at most 60 s), it publishes that in the
  rendezvous store (under ``train.wait.<run id>.<pid>#<local id>``), and withdraws it
  when the wait ends;
- a node whose ranks wait past the bound reads the other members' entries; when every
  member of the round publishes a wait in the same phase (:func:`verdict`), it says so in
  one line, publishes the verdict for the others, and hands it to its waiting ranks
  (:func:`train.core.run.protocol.write_verdict`): each ends as the watchdog's hang
  does (the line, every stack, exit 1), and torchrun meets again from the last
  checkpoint.

Nothing is published before the step time is known (the first step; a long first
backward is no wait), by a node whose ranks compute, or in a round of one node. Entries
come from the network: parsed with bounds (:meth:`NodeWait.parse`), names escaped.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from launcher.liveness.pulse import member_parts
from launcher.liveness.rdzv_state import Round, printable
from train.core.run.protocol import Report, latest_round, read_all, write_verdict

WAIT_PREFIX = "train.wait."
FLOOR_S, CAP_S, STEPS = 30.0, 60.0, 3  # the bound: STEPS step times within [FLOOR, CAP]
LOOK_EVERY_S = 1.0     # a node past the bound reads the others' entries this often
MAX_ENTRY = 16384      # bytes of an entry read from the store
MAX_RANKS = 4096


def bound_s(step_s: float) -> float:
    """How long every node's ranks wait in one phase before it is a partition."""
    return min(CAP_S, max(FLOOR_S, STEPS * step_s))


def wait_key(run_id: str, member_tail: str) -> str:
    """The store key of a member's published wait (``member_tail``: ``pid#local-id``)."""
    return f"{WAIT_PREFIX}{run_id}.{member_tail}"


def verdict_key(run_id: str) -> str:
    return f"{WAIT_PREFIX}{run_id}.verdict"


@dataclass(frozen=True)
class NodeWait:
    """A node whose every local rank waits in a collective in ``phase`` of round
    ``round``: its ranks, for how long (the shortest of them), the agreed step time."""
    round: int
    phase: str
    ranks: tuple[int, ...]
    waited_s: float
    step_s: float

    def to_json(self) -> str:
        return json.dumps({"round": self.round, "phase": self.phase, "ranks": list(self.ranks),
                           "waited_s": round(self.waited_s, 1), "step_s": self.step_s})

    @classmethod
    def parse(cls, raw: bytes | None) -> NodeWait | None:
        """An entry from the store (any client may write it): None unless well formed."""
        if not raw or len(raw) > MAX_ENTRY:
            return None
        try:
            data = json.loads(raw)
            wait = cls(int(data["round"]), printable(data["phase"]),
                       tuple(int(r) for r in data["ranks"][:MAX_RANKS]),
                       float(data["waited_s"]), float(data["step_s"]))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return None
        numbers = (wait.waited_s, wait.step_s)
        return wait if all(math.isfinite(x) and x >= 0 for x in numbers) else None


def local_wait(reports: list[Report], nproc: int, round_number: int,
               now: float) -> NodeWait | None:
    """This node's wait: every local rank of the latest attempt (``nproc`` of them)
    waiting in one phase, with the step time known; None otherwise. ``now``: this host's
    wall clock, as the ranks' ``since``."""
    latest = latest_round(reports)
    waits = [r.waiting for r in latest if r.exit_code is None and r.waiting is not None]
    if not waits or len(waits) != nproc or len(latest) != nproc:
        return None
    steps = [w.step_s for w in waits if w.step_s is not None]
    if len({w.phase for w in waits}) != 1 or len(steps) != len(waits):
        return None
    return NodeWait(round_number, waits[0].phase, tuple(sorted(r.rank for r in latest)),
                    now - max(w.since for w in waits), max(steps))


def verdict(members: dict[str, int], waits: dict[str, NodeWait | None],
            round_number: int) -> str | None:
    """The partition's line when every member of the round (two or more) has published a
    wait of this round, in the same phase, past the bound; None otherwise."""
    found = {m: waits.get(m) for m in members}
    if len(found) < 2 or any(w is None or w.round != round_number for w in found.values()):
        return None
    if len({w.phase for w in found.values()}) != 1:
        return None
    bound = bound_s(max(w.step_s for w in found.values()))
    waited = min(w.waited_s for w in found.values())
    return lost_contact(found, waited) if waited >= bound else None


def lost_contact(found: dict[str, NodeWait], waited_s: float) -> str:
    """One line: which nodes (and ranks) wait for each other, where, for how long."""
    order = sorted(found, key=lambda m: (min(found[m].ranks, default=0), m))
    nodes = ", ".join(f"{printable(m)} {_ranks(found[m].ranks)}" for m in order)
    phase = next(iter(found.values())).phase
    return (f"lost contact between nodes: every node's ranks have waited {phase} for "
            f"{waited_s:.0f} s while the rendezvous store still answers ({nodes}): a network "
            "partition between the nodes (or a hang in a collective); their ranks stop as "
            "hung (stacks in their logs) and the job meets again from its last checkpoint, "
            "training once the nodes reach each other: check the network between them "
            "(links, routes, firewalls, TRAIN_SOCKET_IFNAME)")


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    shown = ", ".join(map(str, ranks[:8]))
    return f"ranks {shown}{', ...' if len(ranks) > 8 else ''}"


class PartitionWatch:
    """A node's side: publish its ranks' shared wait, judge everyone's (above). ``look``
    is called at each look of the round watcher, with its store client and the round."""

    def __init__(self, run_id: str, me: str, folder: str, nproc: int,
                 log: Callable[[str], None]) -> None:
        self.run_id, self.me, self.folder, self.nproc, self.log = run_id, me, folder, nproc, log
        self.published: tuple[int, str] | None = None  # (round, phase) in the store
        self.said: set[tuple[int, str]] = set()
        self.looked_at = -math.inf

    def look(self, store, r: Round) -> str | None:
        """The verdict when this look reached it (said, published, handed to the ranks)."""
        mine, restart = self._mine(r)
        if mine is None or mine.waited_s < bound_s(mine.step_s):
            self._withdraw(store)
            return None
        if self.published != (r.number, mine.phase):
            store.set(wait_key(self.run_id, self.me), mine.to_json())
            self.published = (r.number, mine.phase)
        now = time.monotonic()
        if (r.number, mine.phase) in self.said or now - self.looked_at < LOOK_EVERY_S:
            return None
        self.looked_at = now
        line = self._adopted(store, mine) or verdict(r.members, self._read(store, r), r.number)
        if line is None:
            return None
        self.said.add((r.number, mine.phase))
        store.set(verdict_key(self.run_id), json.dumps(
            {"round": r.number, "phase": mine.phase, "line": line}))
        self.log(line)
        write_verdict(self.folder, restart, mine.phase, line)
        return line

    def _mine(self, r: Round) -> tuple[NodeWait | None, int]:
        if not r.complete or len(r.members) < 2:
            return None, 0
        # a rank killed while it waited (a lost node's restart) left its report behind
        reports = [r for r in latest_round(read_all(self.folder)) if _alive(r.pid)]
        restart = reports[0].restart if reports else 0
        return local_wait(reports, self.nproc, r.number, time.time()), restart

    def _withdraw(self, store) -> None:
        if self.published is not None:
            store.delete_key(wait_key(self.run_id, self.me))
            self.published = None

    def _read(self, store, r: Round) -> dict[str, NodeWait | None]:
        found: dict[str, NodeWait | None] = {}
        for member in r.members:
            key = wait_key(self.run_id, member_parts(member)[1])
            found[member] = NodeWait.parse(store.get(key)) if store.check([key]) else None
        return found

    def _adopted(self, store, mine: NodeWait) -> str | None:
        """Another node's verdict on this same wait (its look came first)."""
        key = verdict_key(self.run_id)
        raw = store.get(key) if store.check([key]) else None
        if not raw or len(raw) > MAX_ENTRY:
            return None
        try:
            data = json.loads(raw)
            same = data["round"] == mine.round and data["phase"] == mine.phase
            return printable(str(data["line"]), 600) if same else None
        except (ValueError, TypeError, KeyError):
            return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's: it exists
    return True
