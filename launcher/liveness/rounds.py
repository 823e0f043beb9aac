"""A worker node's view of its job's rendezvous rounds, and what it tells about liveness.

:class:`RoundWatcher` polls the rendezvous store as a client while torchrun runs: its
launcher logs one line per round (members, who joined or left, what it waits for and
until when) and a periodic "still waiting" line while a round is blocked. It tells a
vanished member (stopped keep-alives, a pulse that completes no handshake:
:mod:`launcher.liveness.pulse`) from a starved one, and notices when this node was left
out of a newer round, and has :mod:`launcher.liveness.partition` name nodes whose ranks
all wait for each other while they still reach the store (a partition). The standalone
store's own log of the same rounds is :func:`launcher.commands.rendezvous.watch`.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Callable

from launcher.liveness.partition import PartitionWatch
from launcher.liveness.pulse import REPROBE_S, Pulse, answers, member_parts, pulse_key
from launcher.liveness.rdzv_state import (
    PREFIX,
    STORE_ERRORS,
    Round,
    describe,
    expire_members,
    read_round,
)


def reachable(endpoint: str, timeout_s: float = 1.0) -> bool:
    """Does something accept connections at host:port?"""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class RoundWatcher(threading.Thread):
    """A node's view of its job's rendezvous: polls the store (as a client) while
    torchrun runs and logs each round, who joined or left, and waits that drag on.
    Quiet when the store is unreachable: the supervisor reports that.

    It also notices a node that *vanished* (power loss, a partition: no connection was
    closed, so the workers wait in a collective until its timeout): a member of the
    running round silent for ``lost_after_s``, or dropped from it by the agents' own
    clean-up, is passed to ``on_lost`` once, which stops this node's workers so that
    torchrun meets again without it.

    The other side of that: a node that was cut off sees, once it reaches the store
    again, a newer round without itself (``me``: the end of its own member name,
    ":pid#local-id"). Its workers still wait in the old world's collective, until its
    timeout; ``on_left_out`` (given the round) stops them, and torchrun joins again.
    Nodes that lost each other but reach the store: ``partition`` looks at each poll."""

    def __init__(self, endpoint: str, run_id: str, nnodes: tuple[int, int],
                 join_timeout_s: int, log: Callable[[str], None], poll_s: float = 0.5,
                 still_every_s: float = 15.0, lost_after_s: float = 10.0,
                 on_lost: Callable[[list[str], str], None] | None = None,
                 me: str | None = None,
                 on_left_out: Callable[[int], None] | None = None,
                 silence_s: float | None = None, pulse: Pulse | None = None,
                 partition: PartitionWatch | None = None) -> None:
        super().__init__(name="rendezvous-watch", daemon=True)
        self.endpoint, self.key, self.run_id = endpoint, PREFIX + run_id, run_id
        self.nnodes, self.join_timeout_s, self.log = nnodes, join_timeout_s, log
        self.poll_s, self.still_every_s = poll_s, still_every_s
        self.lost_after_s, self.on_lost = lost_after_s, on_lost
        self.me, self.on_left_out = me, on_left_out
        self.silence_s = lost_after_s if silence_s is None else max(silence_s, lost_after_s)
        self.pulse, self.published = pulse, False
        self.partition = partition  # every node's ranks waiting for the others, named
        self.starved_said: set[tuple[int, str]] = set()
        self.answered: dict[str, float] = {}  # member -> when its pulse last answered
        self.store = None
        self.lost_reported = -1            # the round whose lost members were passed on
        self.unreachable_since: float | None = None
        self.answered_once = False         # a store not up yet is not a lost one
        self.stop = threading.Event()
        self.last: Round | None = None
        self.members: set[str] = set()     # of the last complete round
        self.members_round = -1
        self.forming_since: float | None = None
        self.said_still = 0.0

    def run(self) -> None:
        store = None
        while not self.stop.wait(self.poll_s):
            # A plain connection first: torch's store client prints C++ stack frames on
            # every call to a store that went away.
            if not reachable(self.endpoint):
                store = None  # gone or restarting: the supervisor reports that
                if self.unreachable_since is None and self.answered_once:
                    self.unreachable_since = time.monotonic()
                continue
            self.unreachable_since, self.answered_once = None, True
            try:
                store = self.store = store or self._connect()
                self._publish(store)
                if store.check([self.key]):
                    self.observe(read_round(store.get(self.key)))
                if self.partition is not None and self.last is not None:
                    self.partition.look(store, self.last)
            except Exception:
                # The watcher's loop is a thread of the launcher: one look that fails (the
                # store going away mid-call, a callback stopping the workers) must not end
                # the watching for the rest of the run; the next look starts afresh.
                store = None

    def _publish(self, store) -> None:
        """Where this node's pulse listens, once, for the peers' probes."""
        if self.published or self.pulse is None or not self.me:
            return
        store.set(pulse_key(self.run_id, self.me.lstrip(":")), self.pulse.where)
        self.published = True

    def unreachable_for(self) -> float:
        """Seconds the store has not answered a connection since it last did (0 while it
        answers, and before it first did: on a busy machine the store's node may start
        its torchrun well after this one, which torchrun itself waits for)."""
        since = self.unreachable_since
        return 0.0 if since is None else time.monotonic() - since

    def _connect(self):
        import torch.distributed as dist
        host, _, port = self.endpoint.rpartition(":")
        return dist.TCPStore(host.strip("[]"), int(port), is_master=False,
                             timeout=datetime.timedelta(seconds=5))

    def observe(self, r: Round | None, now: float | None = None) -> None:
        """Log what changed since the last look (also called by tests with a Round)."""
        if r is None:
            return
        now = time.monotonic() if now is None else now
        if self.last is None or r.key() != self.last.key():
            self.log(f"rendezvous {describe(r)}{self._change(r)}")
            self.said_still = now
        if r.complete and r.number == self.members_round:
            self._lost(r)
        if r.complete and r.number != self.members_round:
            if self._was_member(self.members) and not self._was_member(r.members) and \
                    self.on_left_out is not None:
                self.on_left_out(r.number)
            self.members, self.members_round = set(r.members), r.number
        if r.complete:
            self.forming_since = None
        elif self.forming_since is None or (self.last and r.number != self.last.number):
            self.forming_since = now
        elif now - self.said_still >= self.still_every_s:
            waited = now - self.forming_since
            self.log(f"rendezvous: still waiting in round {r.number}: {len(r.members)} node(s) "
                     f"joined, at least {self.nnodes[0]} needed, for {waited:.0f} s (gives up "
                     f"after distributed.rdzv_join_timeout_s={self.join_timeout_s})")
            self.said_still = now
        self.last = r

    def _was_member(self, members) -> bool:
        return self.me is not None and any(m.endswith(self.me) for m in members)

    def _lost(self, r: Round) -> None:
        """Members of the running round that are gone: dropped from it without a new
        round (torch's agents drop a member whose keep-alive expired), silent past
        ``silence_s``, or silent past ``lost_after_s`` with a pulse that does not answer."""
        if self.on_lost is None or self.lost_reported == r.number:
            return
        gone = sorted(self.members - set(r.members))
        silent = sorted(n for n, age in r.silent.items() if age >= self.lost_after_s)
        if self._was_member(silent):
            # this node's own keep-alives are late too: a slow store or a busy node,
            # no evidence that the others vanished (their drop, once due, still counts)
            silent = []
        frozen = [n for n in silent if r.silent[n] >= self.silence_s]
        vanished = [n for n in silent if n not in frozen and not self._answers(n)]
        self._say_starved(r, [n for n in silent if n not in frozen and n not in vanished])
        if vanished:
            self._expire(vanished)
        if gone or frozen or vanished:
            self.lost_reported = r.number
            self.on_lost(gone + frozen + vanished, self._why(r, frozen, vanished))

    def _why(self, r: Round, frozen: list[str], vanished: list[str]) -> str:
        """The reason for on_lost's line."""
        if not frozen and not vanished:
            return "its keep-alive expired: its host is down or cut off"
        silent = max(r.silent[n] for n in frozen + vanished)
        if frozen and self.silence_s > self.lost_after_s:
            return (f"no heartbeat for {silent:.0f} s, past distributed.heartbeat_silence_s: "
                    "frozen, or its host is down or cut off")
        return f"no heartbeat for {silent:.0f} s: its host is down or cut off"

    def _answers(self, member: str) -> bool:
        """Does the member's pulse complete a handshake (False: none published)? One that
        answered is taken at its word for REPROBE_S: the watcher looks every poll_s."""
        last = self.answered.get(member)
        if last is not None and time.monotonic() - last < REPROBE_S:
            return True
        if self._probe(member):
            self.answered[member] = time.monotonic()
            return True
        return False

    def _probe(self, member: str) -> bool:
        addr, tail = member_parts(member)
        key = pulse_key(self.run_id, tail)
        try:
            where = self.store.get(key).decode() if self.store and self.store.check([key]) \
                else None
        except (*STORE_ERRORS, UnicodeDecodeError):
            where = None
        return where is not None and answers(where, addr)

    def _say_starved(self, r: Round, members: list[str]) -> None:
        for n in members:
            if (r.number, n) not in self.starved_said:
                self.starved_said.add((r.number, n))
                self.log(f"rendezvous: node {n} has been silent for {r.silent[n]:.0f} s but "
                         "its host answers (starved of CPU or paused): it keeps its place "
                         f"until distributed.heartbeat_silence_s={self.silence_s:.0f}")

    def _expire(self, members: list[str]) -> None:
        """Let the agents drop vanished members now rather than at their expiry."""
        if self.store is None:
            return
        try:
            expire_members(self.store, self.key, members)
        except STORE_ERRORS:
            pass  # torch's own expiry still drops them, later

    def _change(self, r: Round) -> str:
        """Who joined and who left since the previous complete round."""
        if not r.complete or not self.members or r.number == self.members_round:
            return ""
        joined = sorted(set(r.members) - self.members)
        left = sorted(self.members - set(r.members))
        parts = ([f"joined: {', '.join(joined)}"] if joined else []) + \
            ([f"left: {', '.join(left)}"] if left else [])
        return "; " + "; ".join(parts) if parts else ""
