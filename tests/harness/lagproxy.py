"""A TCP relay on 127.0.0.1 in front of an HTTP server (the test S3 server) that holds up
the answers of chosen requests: for the tests of a range that lags
(train/data/hedging.py), deterministically, with no timing in the test.

Every connection is relayed byte for byte to the server. The relay reads each request's
head as it passes (keep-alive: one request after another on a connection) and records it
(:attr:`LagProxy.heads`); the first ``lags`` requests whose head ``chosen`` picks get
their answer's head and ``hold_body`` bytes of its body through, and the rest only after
:meth:`LagProxy.release` of that request (by its number, in the order they were chosen),
or after ``hold_s`` (a test that waits for something that never comes fails, not hangs).
:attr:`LagProxy.closed` counts the chosen requests' connections the client closed.

    with LagProxy(upstream_port, chosen=lambda head: "bytes=0-" in head) as proxy:
        ... proxy.endpoint ...; proxy.held[0].wait(); proxy.release(0)
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Callable

HEAD_END = b"\r\n\r\n"
LENGTH = re.compile(r"(?im)^content-length:\s*(\d+)\s*$")


class LagProxy:
    def __init__(self, upstream_port: int, chosen: Callable[[str], bool], lags: int = 1,
                 hold_body: int = 0, hold_s: float = 120,
                 upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.chosen, self.hold_body, self.hold_s = chosen, hold_body, hold_s
        self.heads: list[str] = []
        self.held = [threading.Event() for _ in range(lags)]      # its answer is held now
        self._go = [threading.Event() for _ in range(lags)]
        self.closed = [threading.Event() for _ in range(lags)]    # the client closed it
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name="lagproxy", daemon=True).start()

    def __enter__(self) -> LagProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def release(self, k: int) -> None:
        """Let the ``k``-th chosen request's answer go on."""
        self._go[k].set()

    def close(self) -> None:
        for go in self._go:
            go.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in [self._listener, *sockets]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.upstream)
            with self._lock:
                self._sockets += [client, server]
            lagging: list[int] = []  # the chosen request under way on this connection
            threading.Thread(target=self._requests, args=(client, server, lagging),
                             daemon=True).start()
            threading.Thread(target=self._answers, args=(server, client, lagging),
                             daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket,
                  lagging: list[int]) -> None:
        """Client to server: each request's head recorded (and maybe chosen) as it passes,
        its body (``Content-Length``) passed on as it is."""
        pending, body = b"", 0
        while True:
            data = _received(client)
            if not data:
                for k in lagging:
                    self.closed[k].set()
                with contextlib.suppress(OSError):
                    server.shutdown(socket.SHUT_WR)
                return
            pending += data
            while pending:
                if body:
                    n = min(body, len(pending))
                    server.sendall(pending[:n])
                    pending, body = pending[n:], body - n
                    continue
                if HEAD_END not in pending:
                    break
                head, _, pending = pending.partition(HEAD_END)
                text = head.decode("latin-1")
                self._note(text, lagging)
                server.sendall(head + HEAD_END)
                body = int(LENGTH.search(text)[1]) if LENGTH.search(text) else 0

    def _note(self, head: str, lagging: list[int]) -> None:
        with self._lock:
            self.heads.append(head)
            picked = sum(1 for h in self.heads[:-1] if self.chosen(h))
            if self.chosen(head) and picked < len(self.held):
                lagging.append(picked)

    def _answers(self, server: socket.socket, client: socket.socket,
                 lagging: list[int]) -> None:
        """Server to client, held where a chosen request's answer reaches its hold."""
        seen, holding = b"", None
        while True:
            data = _received(server)
            if not data:
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)
                return
            if lagging and holding is None:
                holding, seen = lagging[-1], b""
            if holding is not None and not self._go[holding].is_set():
                seen += data
                end = seen.find(HEAD_END)
                if end < 0 or len(seen) - end - len(HEAD_END) < self.hold_body:
                    continue  # not yet at the hold: keep collecting
                cut = end + len(HEAD_END) + self.hold_body
                with contextlib.suppress(OSError):
                    client.sendall(seen[:cut])
                self.held[holding].set()
                self._go[holding].wait(self.hold_s)  # a test that never releases ends
                self._go[holding].set()
                data, seen = seen[cut:], b""
            with contextlib.suppress(OSError):
                client.sendall(data)


def _received(sock: socket.socket) -> bytes:
    """What ``sock`` gives next; empty once it is closed or reset."""
    try:
        return sock.recv(1 << 16)
    except OSError:
        return b""
