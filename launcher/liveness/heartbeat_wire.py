"""The heartbeat's wire and the rank-0 node's table (:mod:`launcher.liveness.heartbeat` says what
the heartbeat is for): connections tuned so that the kernel ends them when the peer's
host is gone, a name resolved once with a bound, the listener bound before any worker
starts, lines of JSON read from a stream, and :class:`Watch`, which decides from the
beats and the connections which node is lost.

Only the job's own messages count. Every message carries the job's token (derived from
the job's id, which every node of a static job shares: it keeps another job's or a
stray program's lines out, not an attacker: docs/security.md); a beat must name a rank
of the job other than 0, a count and a short address. Anything else (a malformed line, a
foreign token, a rank out of range, a line longer than :data:`MOST_LINE` bytes, whose
connection is then closed) is ignored and counted, and never stops the watch.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

RESOLVE_S = 5.0   # one attempt to resolve the rank-0 node's name (a nameserver may hang)
MOST_LINE = 4096  # bytes of one message: a beat is under 200
EADDRNOTAVAIL = 99


def token_of(job: str | None) -> str:
    """The token every message of the job carries (the same on every node)."""
    return hashlib.sha256(f"trainpod-heartbeat\0{job or ''}".encode()).hexdigest()[:16]


def listen(master: str, port: int) -> tuple[socket.socket, str | None]:
    """The rank-0 node's listener (on its own address when ``master`` resolves to it, else
    on every interface, said in the note returned); OSError naming the port when another
    program holds it: before any worker starts, so that the job fails at once."""
    ip = resolve(master, port)
    for host in ([ip] if ip else []) + [""]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            if host and exc.errno == EADDRNOTAVAIL:  # the name is not this node's
                continue
            raise OSError(exc.errno, f"the heartbeat port {port} (MASTER_PORT + 1) cannot "
                                     f"be listened on: {exc.strerror}") from None
        sock.listen(64)
        sock.setblocking(False)
        note = None if host else (f"heartbeat listening on every interface, port {port}: "
                                  f"{master} does not resolve to this node")
        return sock, note
    raise OSError(EADDRNOTAVAIL, f"the heartbeat port {port} cannot be listened on")


def beat_of(message: Any, nnodes: int, token: str) -> tuple[int, int, str] | None:
    """(rank, count, address) of a well-formed beat of this job, else None."""
    if not isinstance(message, dict) or message.get("job") != token:
        return None
    rank, count, where = message.get("rank"), message.get("beat"), message.get("where")
    if type(rank) is not int or not 0 < rank < nnodes or type(count) is not int or \
            count < 0 or not isinstance(where, str) or len(where) > 255:
        return None
    return rank, count, where


def ours(message: Any, token: str) -> bool:
    """A message of this job (a goodbye, node 0's view)."""
    return isinstance(message, dict) and message.get("job") == token


def tune(sock: socket.socket, lost_after_s: float) -> None:
    """A connection that ends when the peer's host is gone: unacknowledged data for
    ``lost_after_s`` (TCP_USER_TIMEOUT), or unanswered keep-alive probes when idle."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1),
                        ("TCP_KEEPCNT", max(2, int(lost_after_s))),
                        ("TCP_USER_TIMEOUT", int(lost_after_s * 1000))):
        if hasattr(socket, name):  # Linux
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def resolve(host: str, port: int, timeout_s: float = RESOLVE_S) -> str | None:
    """An IPv4 address of ``host``, or None when it does not resolve within timeout_s
    (getaddrinfo itself cannot be interrupted: it runs in a thread left behind)."""
    found: list[str] = []

    def look() -> None:
        try:
            infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
            found.append(infos[0][4][0])
        except OSError:
            pass
    t = threading.Thread(target=look, name="heartbeat-resolve", daemon=True)
    t.start()
    t.join(timeout_s)
    return found[0] if found else None


@dataclass
class Peer:
    """What the rank-0 node knows of one node."""
    where: str
    beat: int = -1
    changed: float = field(default_factory=time.monotonic)
    gone: str | None = None       # why its connection ended (None while it lasts)
    left: bool = False            # said goodbye: its run is over


class Watch:
    """The rank-0 node's view: which nodes beat, and the first one lost."""

    def __init__(self, lost_after_s: float, silence_s: float):
        self.lost_after_s, self.silence_s = lost_after_s, silence_s
        self.peers: dict[int, Peer] = {}
        self.lost: str | None = None

    def beat(self, rank: int, count: int, where: str, now: float) -> None:
        peer = self.peers.setdefault(rank, Peer(where, changed=now))
        peer.where, peer.gone = where, None
        if count != peer.beat:
            peer.beat, peer.changed = count, now

    def ended(self, rank: int, why: str | None, now: float) -> None:
        """Its connection ended: ``why`` None is a goodbye."""
        peer = self.peers.get(rank)
        if peer is None:
            return
        if why is None:
            peer.left = True
        elif peer.gone is None:  # silence still counts from its last beat
            peer.gone = why

    def check(self, now: float) -> str | None:
        """The first lost node's line, once there is one."""
        for rank, peer in sorted(self.peers.items()):
            if self.lost or peer.left:
                continue
            silent = now - peer.changed
            if peer.gone is not None and silent > self.lost_after_s:
                self.lost = (f"lost node {rank} ({peer.where}): no heartbeat for "
                             f"{silent:.0f} s, its connection ended ({peer.gone})")
            elif peer.gone is None and silent > self.silence_s:
                self.lost = (f"lost node {rank} ({peer.where}): no heartbeat for "
                             f"{silent:.0f} s though its host answers (frozen or stopped)")
        return self.lost


class Conn:
    """One connection's socket and the partial line read so far."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buffer = sock, b""
        self.rank: int | None = None
        self.bye = False
        self.heard: float | None = None
        self.junk = 0            # lines that were not JSON, or too long
        self.overlong = False    # a line longer than MOST_LINE: the connection is closed

    def lines(self, data: bytes) -> list[Any]:
        """The messages completed by ``data``; what cannot be one is counted in ``junk``."""
        self.buffer += data
        *complete, self.buffer = self.buffer.split(b"\n")
        if len(self.buffer) > MOST_LINE:
            self.buffer, self.overlong = b"", True
            self.junk += 1
        out = []
        for line in complete:
            try:
                out.append(json.loads(line) if len(line) <= MOST_LINE else None)
            except ValueError:
                out.append(None)
            if out[-1] is None:
                self.junk += 1
                out.pop()
        return out
