"""Telling a starved node from a vanished one in an elastic job.

The rendezvous keep-alives that torchrun's agents write into the store say only that a
node's agent ran recently. An agent that did not run for a few seconds is either gone
(its host lost power, its link was cut, its processes were killed) or merely starved
(a machine far busier than its cores, a node paused by its hypervisor or stopped for a
while). Evicting the second costs every node a restart and then another when it comes
back; keeping the first costs every node its wait.

The signal a starved process still gives is its kernel's: a listening socket completes
TCP handshakes (into the listen backlog) whether or not its process gets CPU. So every
elastic node's launcher listens on a *pulse* socket at its own address and publishes
where in the rendezvous store (under ``train.pulse.<run id>.<pid>#<local id>``, the tail
of its member name). A peer that sees a member's keep-alives stop probes that socket:

- the handshake completes: the host is up and the launcher's process exists, only it
  does not run; the member keeps its place until ``distributed.heartbeat_silence_s``;
- refused, unreachable or no answer within the bound: gone, evicted at once.

The pulse reads nothing and writes nothing: a thread accepts each connection and closes
it, so a client learns only that the node is there.
"""

from __future__ import annotations

import errno
import socket
import threading

from launcher.liveness.heartbeat_wire import resolve

PULSE_PREFIX = "train.pulse."
PROBE_S = 1.0      # a host that completes no handshake in this long counts as gone
REPROBE_S = 2.0    # a member that answered is not probed again sooner
BACKLOG = 4096     # handshakes the kernel completes for a process that does not run


def pulse_key(run_id: str, member_tail: str) -> str:
    """The store key of a member's pulse (``member_tail``: ``pid#local-id``)."""
    return f"{PULSE_PREFIX}{run_id}.{member_tail}"


def member_parts(member: str) -> tuple[str, str]:
    """(address, ``pid#local-id``) of a member name as
    :mod:`launcher.liveness.rdzv_state` writes it."""
    addr, _, tail = member.rpartition(":")
    return addr.strip("[]"), tail


class Pulse(threading.Thread):
    """This node's pulse socket: listens on ``address`` (this node's address for its
    peers), accepts and closes."""

    def __init__(self, address: str) -> None:
        super().__init__(name="pulse", daemon=True)
        self.sock = _listen(address)
        self.stop = threading.Event()
        # host:port to publish ("" host: every interface; peers use the member address)
        host, port = self.sock.getsockname()[:2]
        self.where = f"{'' if host in ('0.0.0.0', '::') else host}:{port}"

    def run(self) -> None:
        self.sock.settimeout(0.5)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def _listen(address: str) -> socket.socket:
    """A listening socket on ``address`` (an ephemeral port); every interface when this
    machine has no such address (a name resolving elsewhere)."""
    for host in (address, ""):
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sock.listen(BACKLOG)
            return sock
        except OSError:
            sock.close()
    raise OSError(f"cannot listen on {address} or any interface")


def answers(where: str, member_addr: str, timeout_s: float = PROBE_S) -> bool:
    """Does the published pulse ``where`` (host:port) complete a TCP handshake?

    A member known by a host name (no ``TRAIN_LOCAL_ADDR``) is resolved with the same
    bound: a nameserver that does not answer says nothing of the member, so an address
    not found in time counts as an answer (the member keeps its place until
    ``distributed.heartbeat_silence_s``, which still ends a real loss)."""
    host, _, port = where.rpartition(":")
    host = host.strip("[]") or member_addr
    try:
        address = _address(host, int(port), timeout_s)
        if address is None:
            return True
        with socket.create_connection((address, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError) as exc:
        # out of file descriptors is this process's own limit, no news of the peer
        return getattr(exc, "errno", None) == errno.EMFILE


def _address(host: str, port: int, timeout_s: float) -> str | None:
    """``host`` as an address: itself when it is one, else its name looked up within
    ``timeout_s`` (None: no answer in time)."""
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return host
    except OSError:
        return resolve(host, port, timeout_s)
