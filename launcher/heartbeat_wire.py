"""The heartbeat's wire and the rank-0 node's table (:mod:`launcher.heartbeat` says what
the heartbeat is for): connections tuned so that the kernel ends them when the peer's
host is gone, a name resolved once with a bound, lines of JSON read from a stream, and
:class:`Watch`, which decides from the beats and the connections which node is lost.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field

RESOLVE_S = 5.0   # one attempt to resolve the rank-0 node's name (a nameserver may hang)


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

    def lines(self, data: bytes) -> list[dict]:
        self.buffer += data
        *complete, self.buffer = self.buffer.split(b"\n")
        out = []
        for line in complete:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                out.append(message)
        return out
