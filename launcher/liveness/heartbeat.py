"""The nodes of a static job watch each other, so a lost node is named in seconds.

A static rendezvous (Kubeflow PyTorchJob v1, torchrun's static ``PET_*``, SLURM) has no
store that tracks members: when a node's host vanishes (power loss, a partition: no
connection is closed), the other nodes' workers wait in a collective until its timeout
(``distributed.timeout_s``, minutes). So the launchers beat: the rank-0 node's launcher
listens at ``MASTER_PORT + 1``, every other node's launcher keeps one TCP connection to
it, sends a beat every second and gets the rank-0 node's view back every second.

What makes a node lost, and what does not:

- *Its host vanished*: the kernel notices first. Each connection carries data both ways
  every second, and ``TCP_USER_TIMEOUT`` ends it when what was sent stays unacknowledged
  for ``lost_after_s`` (a host that is gone acknowledges nothing).
- *Its processes froze* (stopped, hung) while its host answers: no beat for
  ``silence_s`` (``distributed.heartbeat_silence_s``). A node merely starved of CPU (a
  loaded machine, a node importing torch) keeps its place: its kernel acknowledges, and
  a beat thread needs only a moment of CPU in ``silence_s``.
- *It has not come yet*: never. Silence counts from when a node's heartbeat was first
  established, so the nodes may start in any order (up to the rendezvous' own wait); a
  node still waiting to reach the rank-0 node says so once, after the join timeout.
- *It ended*: a launcher whose run is over says goodbye; it is not lost.

No name is looked up while beating: the rank-0 node's address is resolved once (the
listener binds it, not every interface, when it is this node's), and a reconnect uses
the address already found. Nothing is unpickled: beats are lines of JSON, and only the
job's own well-formed messages count (:mod:`launcher.liveness.heartbeat_wire`): a stray line, a
stranger naming a rank the job does not have, a line without end, are ignored and
counted (said once), never a reason to stop. The rank-0 node's launcher binds its port
before any worker starts (:func:`~launcher.liveness.heartbeat_wire.listen`): a port another
program holds is exit 3 then, not a false loss of node 0 on every other node later.

``on_lost`` gets one line naming the lost node (``lost``, too), and the launcher stops
this node's workers and exits 1 naming it. A static job cannot replace a node: the pods'
restart policy restarts them, and they resume from the last checkpoint.
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from collections.abc import Callable

from launcher.liveness.heartbeat_wire import (
    Conn,
    Watch,
    beat_of,
    listen,
    ours,
    resolve,
    token_of,
    tune,
)


class PeerHeartbeat(threading.Thread):
    """One node's beat and watch (rank 0: the listener; the others: a connection to it)."""

    def __init__(self, master: str, port: int, rank: int, nnodes: int, addr: str,
                 lost_after_s: float, on_lost: Callable[[str], None], *,
                 silence_s: float = 20.0, join_timeout_s: float = 600.0,
                 log: Callable[[str], None] = lambda line: None, beat_s: float = 1.0,
                 job: str | None = None, listener: socket.socket | None = None) -> None:
        super().__init__(name="peer-heartbeat", daemon=True)
        self.master, self.port, self.rank, self.nnodes = master, port, rank, nnodes
        self.addr, self.on_lost, self.log, self.beat_s = addr, on_lost, log, beat_s
        self.lost_after_s, self.silence_s = lost_after_s, silence_s
        self.join_timeout_s = join_timeout_s
        self.stop = threading.Event()
        self.lost: str | None = None
        self.watch = Watch(lost_after_s, silence_s)
        self.heard_node_0 = False  # a non-zero node: node 0's view reached it
        self.beats_started = self.beats_read = 0  # a non-zero node's beats to node 0
        self.token, self.listener = token_of(job), listener  # rank 0: bound by the launcher
        self.ignored = 0  # messages that were not the job's own well-formed ones

    def run(self) -> None:
        try:
            (self._serve if self.rank == 0 else self._beat)()
        except Exception as exc:  # the watch must never take the launcher down
            self.log(f"heartbeat stopped ({type(exc).__name__}: {exc}); a lost node is left "
                     "to distributed.timeout_s")

    def close(self) -> None:
        self.stop.set()

    def word_of_node_0(self, within_s: float) -> str | None:
        """The lost node's line, once this node's workers failed: their failure may be the
        echo of a loss node 0 named (it stopped its own workers, and these ranks lost their
        connection to them), and node 0 tells the others before it stops its workers. So
        the next beat, which starts after this call, reads that word if it was sent; waited
        for at most ``within_s``. Node 0, or a watch that ended: what it knows."""
        asked, deadline = self.beats_started, time.monotonic() + within_s
        while (self.rank and self.lost is None and self.is_alive()
               and self.beats_read <= asked and time.monotonic() < deadline):
            time.sleep(0.02)
        return self.lost

    def _lose(self, what: str) -> None:
        if self.lost is None:
            self.lost = f"{what} (its host is down or cut off)" if "frozen" not in what \
                else what
            self.on_lost(self.lost)

    # ---------------------------------------------------------------- rank 0
    def _listen(self) -> socket.socket | None:
        """The listener the launcher bound, or bound here; None (said once) when the port
        is taken."""
        if self.listener is not None:
            return self.listener
        try:
            sock, note = listen(self.master, self.port)
        except OSError as exc:
            self.log(f"heartbeat not started: {exc.strerror}; a lost node is left to "
                     "distributed.timeout_s")
            return None
        if note:
            self.log(note)
        return sock

    def _serve(self) -> None:
        listener = self._listen()
        if listener is None:
            return
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, None)
        conns: dict[socket.socket, Conn] = {}
        next_push = time.monotonic()
        try:
            while not self.stop.is_set():
                for key, _ in sel.select(timeout=self.beat_s / 4):
                    if key.data is None:
                        self._accept(listener, sel, conns)
                    else:
                        self._receive(key.data, sel, conns)
                now = time.monotonic()
                lost = self.watch.check(now)
                if now >= next_push or lost:
                    self._push(sel, conns, lost)
                    next_push = now + self.beat_s
                if lost:
                    self._lose(lost)
                    return
        finally:
            if self.lost is None:  # the run is over here: the others stop watching node 0
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
        tune(sock, self.lost_after_s)
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
            beat = beat_of(message, self.nnodes, self.token)
            if beat is None and ours(message, self.token) and message.get("bye"):
                conn.bye = True
            elif beat is None:
                junk += 1
            else:
                conn.rank, count, where = beat
                if conn.rank not in self.watch.peers:
                    self.log(f"heartbeat: node {conn.rank} ({where}) beats")
                self.watch.beat(conn.rank, count, where, now)
        self._ignore(junk, conn)
        if conn.overlong:  # a line without end: whoever sends it is no node of the job
            self._drop(conn, sel, conns, "a line too long", now)

    def _ignore(self, count: int, conn: Conn) -> None:
        """Messages that are not this job's beats: counted, said the first time."""
        if count and not self.ignored:
            try:
                host, port = conn.sock.getpeername()[:2]
                peer = f"{host}:{port}"
            except OSError:
                peer = "?"
            self.log(f"heartbeat: ignoring messages that are not this job's beats (from "
                     f"{peer}: malformed, another job's, or a rank the job does not have)")
        self.ignored += count

    def _drop(self, conn: Conn, sel, conns: dict, why: str, now: float) -> None:
        sel.unregister(conn.sock)
        conn.sock.close()
        conns.pop(conn.sock, None)
        if conn.rank is not None:
            self.watch.ended(conn.rank, None if conn.bye else why, now)

    def _push(self, sel, conns: dict, lost: str | None, bye: bool = False) -> None:
        line = (json.dumps({"lost": lost, "bye": bye, "job": self.token}) + "\n").encode()
        for conn in list(conns.values()):
            try:
                conn.sock.send(line)
            except OSError as exc:
                self._drop(conn, sel, conns, exc.strerror or "send failed", time.monotonic())

    # ------------------------------------------------------------ other ranks
    def _beat(self) -> None:
        ip, sock, count = None, None, 0
        started = reached = time.monotonic()
        established, said_waiting = False, False
        conn: Conn | None = None
        while not self.stop.wait(self.beat_s):
            now = time.monotonic()
            if sock is None:
                ip = ip or resolve(self.master, self.port)
                sock = self._connect(ip) if ip else None
                if sock is None:
                    if established and now - reached > self.lost_after_s:
                        return self._lose(f"lost node 0 ({self.master}): no heartbeat for "
                                          f"{now - reached:.0f} s, its connection ended")
                    if not established and not said_waiting and \
                            now - started > self.join_timeout_s:
                        said_waiting = True
                        self.log(f"heartbeat: node 0 ({self.master}:{self.port}) has not "
                                 f"answered for {now - started:.0f} s; still trying")
                    continue
                conn, established, reached = Conn(sock), True, now
            count += 1
            self.beats_started = count
            try:
                sock.sendall((json.dumps({"rank": self.rank, "beat": count, "where": self.addr,
                                          "job": self.token}) + "\n").encode())
                lost = self._read_pushes(conn, now)
                self.beats_read = count
            except OSError:
                sock.close()
                sock = None
                continue
            if conn.heard is not None:
                reached, self.heard_node_0 = conn.heard, True
            if lost:
                return self._lose(lost)
            if conn.bye:  # node 0's run is over: nothing more to watch
                return sock.close()
            if now - reached > self.silence_s:
                return self._lose(f"lost node 0 ({self.master}): no heartbeat for "
                                  f"{now - reached:.0f} s though its host answers (frozen "
                                  "or stopped)")
        self._goodbye(sock, self.token)

    def _connect(self, ip: str) -> socket.socket | None:
        try:
            sock = socket.create_connection((ip, self.port), timeout=self.beat_s * 2)
        except OSError:
            return None
        tune(sock, self.lost_after_s)
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
                if not ours(message, self.token):
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
