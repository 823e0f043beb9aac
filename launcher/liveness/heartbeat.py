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

import socket
import threading
import time
from collections.abc import Callable

from launcher.liveness.heartbeat_beat import Beater
from launcher.liveness.heartbeat_hub import Hub
from launcher.liveness.heartbeat_wire import Watch, token_of


class PeerHeartbeat(threading.Thread):
    """One node's beat and watch, and its verdict: which node is lost (rank 0: the
    listener, :class:`~launcher.liveness.heartbeat_hub.Hub`; the others: a connection to
    it, :class:`~launcher.liveness.heartbeat_beat.Beater`)."""

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
            Hub(self).serve() if self.rank == 0 else Beater(self).beat()
        except Exception as exc:
            # The watch is a thread of the launcher and must never take it down, whatever
            # a peer sends or a socket raises: said once, the loss is left to the timeout.
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

    def lose(self, what: str) -> None:
        """The verdict, once: the lost node's line, said to ``on_lost``."""
        if self.lost is None:
            self.lost = f"{what} (its host is down or cut off)" if "frozen" not in what \
                else what
            self.on_lost(self.lost)
