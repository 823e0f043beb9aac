"""The nodes of a static job watch each other, so a vanished node is named in seconds.

A static rendezvous (Kubeflow PyTorchJob v1, torchrun's static ``PET_*``) has no store
that tracks members: when a node's host vanishes (power loss, a partition: no
connection is closed), the other nodes' workers wait in a collective until its timeout
(``distributed.timeout_s``, minutes). So each node's launcher beats here: the rank-0
node's launcher serves a small ``TCPStore`` at the rank-0 address's
``MASTER_PORT + 1``, every launcher writes its own counter there every second and reads
the others'. A node whose counter stops for ``lost_after_s`` (or, for the others, the
rank-0 node itself when its store stops answering) is lost: ``on_lost`` stops this
node's workers and the launcher exits 1 naming it. A static job cannot replace a node:
the pods' restart policy restarts them, and they resume from the last checkpoint.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

KEY = "train.heartbeat."


class PeerHeartbeat(threading.Thread):
    """One node's beat and watch; ``lost`` holds the line once a peer is lost."""

    def __init__(self, master: str, port: int, rank: int, nnodes: int, addr: str,
                 lost_after_s: float, on_lost: Callable[[str], None],
                 beat_s: float = 1.0) -> None:
        super().__init__(name="peer-heartbeat", daemon=True)
        self.master, self.port, self.rank, self.nnodes = master, port, rank, nnodes
        self.addr, self.lost_after_s, self.on_lost, self.beat_s = addr, lost_after_s, \
            on_lost, beat_s
        self.stop = threading.Event()
        self.lost: str | None = None
        self.server = None

    def run(self) -> None:
        import torch.distributed as dist

        from launcher.rendezvous import reachable
        if self.rank == 0:  # the store lives with the rank-0 node's launcher
            try:
                self.server = dist.TCPStore("0.0.0.0", self.port, is_master=True,
                                            wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=5))
            except Exception:  # port taken: the collective timeout remains the backstop
                return
        client, count = None, 0
        seen: dict[int, tuple[bytes, float]] = {}   # rank -> (last value, when it changed)
        answered = time.monotonic()
        while not self.stop.wait(self.beat_s):
            now = time.monotonic()
            try:
                # a plain connection first, every beat: torch's client prints C++ frames
                # when its server is gone (as at the end of a run, rank 0 first)
                if not reachable(f"{self.master}:{self.port}"):
                    raise ConnectionError(self.master)
                client = client or dist.TCPStore(self.master, self.port, is_master=False,
                                                 timeout=datetime.timedelta(seconds=2))
                count += 1
                client.set(f"{KEY}{self.rank}", f"{count} {self.addr}")
                values = {r: client.get(f"{KEY}{r}") if client.check([f"{KEY}{r}"]) else None
                          for r in range(self.nnodes) if r != self.rank}
                answered = now
            except Exception:  # the rank-0 node's store does not answer
                client = None
                if self.rank != 0 and now - answered > self.lost_after_s:
                    return self._lose(f"lost node 0 ({self.master}): its heartbeat store did "
                                      f"not answer for {now - answered:.0f} s")
                continue
            for r, value in values.items():
                if value is None:  # not started yet (torchrun's rendezvous waits for it)
                    continue
                last = seen.get(r)
                if last is None or last[0] != value:
                    seen[r] = (value, now)
                elif now - last[1] > self.lost_after_s:
                    where = value.decode(errors="replace").split(" ", 1)[-1]
                    return self._lose(f"lost node {r} ({where}): no heartbeat for "
                                      f"{now - last[1]:.0f} s")

    def _lose(self, what: str) -> None:
        self.lost = f"{what} (its host is down or cut off)"
        self.on_lost(self.lost)

    def close(self) -> None:
        self.stop.set()
