"""The rank-0 node's side of a static job's heartbeat (:mod:`launcher.liveness.heartbeat`
says what the heartbeat is for): the listener, every other node's connection to it, their
beats read into the table that decides who is lost
(:class:`~launcher.liveness.heartbeat_wire.Watch`), and node 0's view pushed back to them
every beat (a lost node's line, or goodbye when its run is over).

Messages that are not the job's own well-formed beats are counted and said once, never a
reason to stop.
"""

from __future__ import annotations

import json
import selectors
import socket
import time
from typing import TYPE_CHECKING

from launcher.liveness.heartbeat_wire import Conn, beat_of, listen, ours, tune

if TYPE_CHECKING:
    from launcher.liveness.heartbeat import PeerHeartbeat


class Hub:
    """Node 0's listener and table, run in its :class:`PeerHeartbeat`'s thread, whose
    settings it reads and whose verdict (``lose``) it reports to."""

    def __init__(self, hb: PeerHeartbeat) -> None:
        self.hb = hb

    def _listener(self) -> socket.socket | None:
        """The listener the launcher bound, or bound here; None (said once) when the port
        is taken."""
        if self.hb.listener is not None:
            return self.hb.listener
        try:
            sock, note = listen(self.hb.master, self.hb.port)
        except OSError as exc:
            self.hb.log(f"heartbeat not started: {exc.strerror}; a lost node is left to "
                        "distributed.timeout_s")
            return None
        if note:
            self.hb.log(note)
        return sock

    def serve(self) -> None:
        listener = self._listener()
        if listener is None:
            return
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, None)
        conns: dict[socket.socket, Conn] = {}
        next_push = time.monotonic()
        try:
            while not self.hb.stop.is_set():
                for key, _ in sel.select(timeout=self.hb.beat_s / 4):
                    if key.data is None:
                        self._accept(listener, sel, conns)
                    else:
                        self._receive(key.data, sel, conns)
                now = time.monotonic()
                lost = self.hb.watch.check(now)
                if now >= next_push or lost:
                    self._push(sel, conns, lost)
                    next_push = now + self.hb.beat_s
                if lost:
                    self.hb.lose(lost)
                    return
        finally:
            if self.hb.lost is None:  # the run is over here: the others stop watching node 0
                self._push(sel, conns, None, bye=True)
            for conn in list(conns.values()):
                conn.sock.close()
            listener.close()
            sel.close()

    def _accept(self, listener: socket.socket, sel, conns: dict) -> None:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        tune(sock, self.hb.lost_after_s)
        sock.setblocking(False)
        conn = Conn(sock)
        conns[sock] = conn
        sel.register(sock, selectors.EVENT_READ, conn)

    def _receive(self, conn: Conn, sel, conns: dict) -> None:
        now = time.monotonic()
        try:
            data = conn.sock.recv(65536)
        except OSError as exc:
            data, why = b"", exc.strerror or type(exc).__name__
        else:
            why = "closed"
        if not data:
            self._drop(conn, sel, conns, why, now)
            return
        messages, junk = conn.lines(data), conn.junk
        conn.junk = 0
        for message in messages:
            beat = beat_of(message, self.hb.nnodes, self.hb.token)
            if beat is None and ours(message, self.hb.token) and message.get("bye"):
                conn.bye = True
            elif beat is None:
                junk += 1
            else:
                conn.rank, count, where = beat
                if conn.rank not in self.hb.watch.peers:
                    self.hb.log(f"heartbeat: node {conn.rank} ({where}) beats")
                self.hb.watch.beat(conn.rank, count, where, now)
        self._ignore(junk, conn)
        if conn.overlong:  # a line without end: whoever sends it is no node of the job
            self._drop(conn, sel, conns, "a line too long", now)

    def _ignore(self, count: int, conn: Conn) -> None:
        """Messages that are not this job's beats: counted, said the first time."""
        if count and not self.hb.ignored:
            try:
                host, port = conn.sock.getpeername()[:2]
                peer = f"{host}:{port}"
            except OSError:
                peer = "?"
            self.hb.log(f"heartbeat: ignoring messages that are not this job's beats (from "
                        f"{peer}: malformed, another job's, or a rank the job does not have)")
        self.hb.ignored += count

    def _drop(self, conn: Conn, sel, conns: dict, why: str, now: float) -> None:
        sel.unregister(conn.sock)
        conn.sock.close()
        conns.pop(conn.sock, None)
        if conn.rank is not None:
            self.hb.watch.ended(conn.rank, None if conn.bye else why, now)

    def _push(self, sel, conns: dict, lost: str | None, bye: bool = False) -> None:
        line = (json.dumps({"lost": lost, "bye": bye, "job": self.hb.token}) + "\n").encode()
        for conn in list(conns.values()):
            try:
                conn.sock.send(line)
            except OSError as exc:
                self._drop(conn, sel, conns, exc.strerror or "send failed", time.monotonic())
