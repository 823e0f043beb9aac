"""A free TCP port on 127.0.0.1 for a server a test starts later (mlflow, SeaweedFS, a
rendezvous store, a heartbeat).

``bind(0)`` hands out a port from the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), the same range every outgoing connection
of every test running beside this one takes its local port from. Between closing the
probe and the server's own bind (an mlflow server binds some seconds after its start
on a loaded machine) one of those connections can take it: "address already in use".
A port below that range is never handed out implicitly; only a program that names it
can take it. The range torchrun's defaults and this project's tests name (29400 to
29600: rendezvous, MASTER_PORT, the heartbeat at MASTER_PORT + 1) is left out too.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

NAMED = range(29000, 30000)  # torchrun's and the tests' own fixed ports live here
LOWEST = 20000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port nothing listens on now, that no outgoing connection will take."""
    top = _ephemeral_start()
    candidates = [p for p in range(LOWEST, top) if p not in NAMED]
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a range with nothing free: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
