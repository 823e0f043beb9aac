"""Reading the rendezvous state that torchrun's agents keep in the c10d store, safely.

The state is a pickled ``_RendezvousState`` under ``torch.rendezvous.<run id>``. It is
read with an allow-list unpickler: stand-in classes hold the fields, nothing else is
ever built (the store is reachable by every node, so its contents are untrusted).
torchrun's agent itself unpickles that key with plain ``pickle.loads``, so a client of
the store could run code in every agent; :mod:`launcher.torchrun` gives the agent
:func:`load_state` instead: the same allow-list with torch's real two classes.
:func:`read_round` turns it into a :class:`Round`; :func:`describe` into one log line.
Node names come from the network and are escaped (:func:`printable`) so that they
cannot forge or garble log lines.
"""

from __future__ import annotations

import base64
import copyreg
import datetime
import io
import pickle
from dataclasses import dataclass, field

PREFIX = "torch.rendezvous."
# What a call of a c10d store client raises: torch's DistError family (its network, store
# and timeout errors, all RuntimeError) and OSError. Torch-free, so the callers can name
# them without importing torch.
STORE_ERRORS = (RuntimeError, OSError)
# A member whose last heartbeat is older than this is shown as silent (torch's
# default keep-alive is 5 s; the launcher sets 2 s).
SILENT_AFTER_S = 5.0


class _Stub:
    """Stands in for torchrun's rendezvous classes: holds their fields, runs no code."""

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)


_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_STUBS = {name: type(name, (_Stub,), {}) for name in ("_RendezvousState", "_NodeDesc")}
_SAFE = {("datetime", "datetime"): datetime.datetime, ("datetime", "timezone"): datetime.timezone,
         ("datetime", "timedelta"): datetime.timedelta, ("copyreg", "_reconstructor"):
         copyreg._reconstructor, ("builtins", "object"): object, ("builtins", "set"): set,
         ("builtins", "frozenset"): frozenset}


class _AllowList(pickle.Unpickler):
    classes = _STUBS  # what the two rendezvous classes are built as

    def find_class(self, module: str, name: str):
        if module == _RDZV and name in self.classes:
            return self.classes[name]
        if (module, name) in _SAFE:
            return _SAFE[(module, name)]
        raise pickle.UnpicklingError(f"refusing {module}.{name}")


def load_state(data: bytes, classes: dict[str, type]) -> object:
    """torch's rendezvous state from its pickle, built with ``classes`` (the real
    ``_RendezvousState`` and ``_NodeDesc``), dates and sets, and nothing else: anything
    more raises ``pickle.UnpicklingError``, which torch reports as a bad state."""
    unpickler = _AllowList(io.BytesIO(data))
    unpickler.classes = classes
    return unpickler.load()


def printable(text: str, limit: int = 80) -> str:
    """Text from the network as one log-safe line: control characters (newlines, ANSI
    escapes) shown as escapes, so a node's name cannot forge or garble log lines."""
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                  for c in str(text))
    return out if len(out) <= limit else out[: limit - 3] + "..."


def node_name(desc: object) -> str:
    """address:pid, with the local id when it is not torch's default (launcher.torchrun
    randomises it so that nodes with the same address and pid stay apart)."""
    local = getattr(desc, "local_id", 0)
    suffix = f"#{local}" if local else ""
    return printable(f"{getattr(desc, 'addr', '?')}:{getattr(desc, 'pid', '?')}{suffix}")


@dataclass(frozen=True)
class Round:
    """One rendezvous round as the store holds it."""
    number: int
    complete: bool
    closed: bool
    deadline: datetime.datetime | None           # when a forming round closes (last call)
    members: dict[str, int] = field(default_factory=dict)  # node -> rank (complete rounds)
    waiting: tuple[str, ...] = ()                # nodes waiting for the next round
    silent: dict[str, float] = field(default_factory=dict)  # member -> seconds since heartbeat

    def key(self) -> tuple:
        """What changes when the round does (not the heartbeats)."""
        return (self.number, self.complete, self.closed, tuple(sorted(self.members)),
                self.waiting, tuple(sorted(self.silent)))


def _unpickled(raw: bytes, unpickler: type[pickle.Unpickler]) -> object | None:
    """The state in a raw store value, built by ``unpickler``'s allow-list; None when it
    is not one."""
    try:
        return unpickler(io.BytesIO(base64.b64decode(raw))).load()
    except Exception:
        # Any client of the store may write the key, and unpickling malformed bytes
        # raises more than UnpicklingError (pickle's docs: AttributeError, EOFError,
        # ImportError, IndexError, and what a stand-in's __setstate__ or a date given
        # odd arguments raise): none of them may stop a watcher; all mean "no state".
        return None


def read_round(raw: bytes, now: datetime.datetime | None = None) -> Round | None:
    """The round in a raw store value; None when unreadable."""
    state = _unpickled(raw, _AllowList)
    if state is None:
        return None
    try:
        return _round_of(state, now or datetime.datetime.now(datetime.UTC))
    except (AttributeError, TypeError, ValueError):  # a state of another shape than torch's
        return None


def _round_of(state: object, now: datetime.datetime) -> Round:
    """The round an unpickled rendezvous state describes, as of ``now``."""
    members = {node_name(n): r for n, r in getattr(state, "participants", {}).items()}
    silent = {}
    for node, beat in getattr(state, "last_heartbeats", {}).items():
        name = node_name(node)
        if name in members and isinstance(beat, datetime.datetime):
            age = (now - beat).total_seconds()
            if age > SILENT_AFTER_S:
                silent[name] = age
    deadline = getattr(state, "deadline", None)
    return Round(number=getattr(state, "round", -1), complete=bool(getattr(state, "complete",
                                                                               False)),
                 closed=bool(getattr(state, "closed", False)),
                 deadline=deadline if isinstance(deadline, datetime.datetime) else None,
                 members=members, silent=silent,
                 waiting=tuple(sorted(node_name(n) for n in getattr(state, "wait_list", ()))))


def _member(name: str, r: Round) -> str:
    silent = f" (silent {r.silent[name]:.0f} s)" if name in r.silent else ""
    rank = f" rank {r.members[name]}" if r.complete else ""
    return f"{name}{rank}{silent}"


def describe(raw_or_round: bytes | Round | None) -> str | None:
    """One line: the round, its members (ranks once complete), who waits to join."""
    r = raw_or_round if isinstance(raw_or_round, Round) or raw_or_round is None \
        else read_round(raw_or_round)
    if r is None:
        return None
    order = sorted(r.members, key=lambda n: (r.members[n], n)) if r.complete else sorted(r.members)
    text = (f"round {r.number} {'complete' if r.complete else 'forming'}: {len(r.members)} "
            f"node(s) [" + ", ".join(_member(n, r) for n in order) + "]")
    if not r.complete and r.deadline is not None:
        text += f"; last call until {r.deadline.astimezone().strftime('%H:%M:%S')}"
    if r.waiting:
        text += f"; waiting to join: {', '.join(r.waiting)}"
    if r.closed:
        text += "; closed (a new job needs a new run id)"
    shared = _shared_addresses(r.members)
    if shared:
        text += (f"; {', '.join(shared)} stand(s) for several nodes, told apart only by the "
                 "random local id: give each node its own TRAIN_LOCAL_ADDR (the pod IP)")
    return text


def _shared_addresses(members) -> list[str]:
    """address:pid pairs that several members present (same hostname and PID tree)."""
    seen: dict[str, int] = {}
    for name in members:
        base = name.split("#", 1)[0]
        seen[base] = seen.get(base, 0) + 1
    return sorted(b for b, n in seen.items() if n > 1)


# A keep-alive this old has expired under any setting: the agents' next look drops it.
_LONG_AGO = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)


class _Real(pickle.Unpickler):
    """The same allow-list, building torch's own classes: only for writing the state
    back (:func:`expire_members`), after :func:`read_round` has read it safely."""

    def find_class(self, module: str, name: str):
        if module == _RDZV and name in _STUBS:
            from torch.distributed.elastic.rendezvous import dynamic_rendezvous
            return getattr(dynamic_rendezvous, name)
        if (module, name) in _SAFE:
            return _SAFE[(module, name)]
        raise pickle.UnpicklingError(f"refusing {module}.{name}")


def expire_members(store, key: str, members: list[str], attempts: int = 5) -> bool:
    """Mark ``members`` (names as :func:`node_name` writes them) as long silent in the
    rendezvous state, so that torch's agents drop them at their next look instead of at
    their keep-alive expiry. A compare-and-set, as the agents' own updates: an update
    that raced with theirs is read again and retried. True once written."""
    wanted = set(members)
    for _ in range(attempts):
        raw = store.get(key)
        state = _unpickled(raw, _Real)
        if state is None:
            return False
        beats = getattr(state, "last_heartbeats", {})
        hit = [node for node in beats if node_name(node) in wanted]
        if not hit:
            return False
        for node in hit:
            beats[node] = _LONG_AGO
        new = base64.b64encode(pickle.dumps(state))
        if store.compare_set(key, raw, new) == new:
            return True
    return False
