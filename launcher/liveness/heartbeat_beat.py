"""Another node's side of a static job's heartbeat (:mod:`launcher.liveness.heartbeat`
says what the heartbeat is for): one connection to the rank-0 node's launcher, a beat
every ``beat_s``, node 0's view read back after each, a reconnect to the address already
resolved, and a goodbye when this node's run is over.

Node 0 is lost when its connection stays ended past ``lost_after_s`` or when it stays
silent past ``silence_s`` though its host answers; a line naming a lost node that node 0
pushed is this node's verdict too.
"""

from __future__ import annotations

import json
import socket
import time
from typing import TYPE_CHECKING

from launcher.liveness.heartbeat_wire import Conn, ours, resolve, tune

if TYPE_CHECKING:
    from launcher.liveness.heartbeat import PeerHeartbeat


class Beater:
    """A non-zero node's beats, run in its :class:`PeerHeartbeat`'s thread, whose settings
    it reads and whose counters and verdict (``lose``) it keeps up to date."""

    def __init__(self, hb: PeerHeartbeat) -> None:
        self.hb = hb

    def beat(self) -> None:
        ip, sock, count = None, None, 0
        started = reached = time.monotonic()
        established, said_waiting = False, False
        conn: Conn | None = None
        while not self.hb.stop.wait(self.hb.beat_s):
            now = time.monotonic()
            if sock is None:
                ip = ip or resolve(self.hb.master, self.hb.port)
                sock = self._connect(ip) if ip else None
                if sock is None:
                    if established and now - reached > self.hb.lost_after_s:
                        return self.hb.lose(f"lost node 0 ({self.hb.master}): no heartbeat "
                                            f"for {now - reached:.0f} s, its connection ended")
                    if not established and not said_waiting and \
                            now - started > self.hb.join_timeout_s:
                        said_waiting = True
                        self.hb.log(f"heartbeat: node 0 ({self.hb.master}:{self.hb.port}) has "
                                    f"not answered for {now - started:.0f} s; still trying")
                    continue
                conn, established, reached = Conn(sock), True, now
            count += 1
            self.hb.beats_started = count
            try:
                sock.sendall((json.dumps({"rank": self.hb.rank, "beat": count,
                                          "where": self.hb.addr, "job": self.hb.token})
                              + "\n").encode())
                lost = self._read_pushes(conn, now)
                self.hb.beats_read = count
            except OSError:
                sock.close()
                sock = None
                continue
            if conn.heard is not None:
                reached, self.hb.heard_node_0 = conn.heard, True
            if lost:
                return self.hb.lose(lost)
            if conn.bye:  # node 0's run is over: nothing more to watch
                return sock.close()
            if now - reached > self.hb.silence_s:
                return self.hb.lose(f"lost node 0 ({self.hb.master}): no heartbeat for "
                                    f"{now - reached:.0f} s though its host answers (frozen "
                                    "or stopped)")
        self._goodbye(sock, self.hb.token)

    def _connect(self, ip: str) -> socket.socket | None:
        try:
            sock = socket.create_connection((ip, self.hb.port), timeout=self.hb.beat_s * 2)
        except OSError:
            return None
        tune(sock, self.hb.lost_after_s)
        sock.setblocking(False)
        return sock

    def _read_pushes(self, conn: Conn, now: float) -> str | None:
        """What the rank-0 node said since the last beat: a lost node's line, if any."""
        lost = None
        while True:
            try:
                data = conn.sock.recv(65536)
            except BlockingIOError:
                return lost
            if not data:
                if lost:  # its last word before it closed
                    return lost
                raise ConnectionError("closed")
            for message in conn.lines(data):
                if not ours(message, self.hb.token):
                    continue  # not node 0's word: another program on its port
                conn.heard = now
                conn.bye = conn.bye or message.get("bye") is True
                said = message.get("lost")
                lost = lost or (said if isinstance(said, str) else None)

    @staticmethod
    def _goodbye(sock: socket.socket | None, token: str) -> None:
        if sock is None:
            return
        try:
            sock.setblocking(True)
            sock.settimeout(1.0)
            sock.sendall((json.dumps({"bye": True, "job": token}) + "\n").encode())
        except OSError:
            pass
        sock.close()
