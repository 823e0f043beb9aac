"""A fixed delay on what one host of tests/harness/netns.py sends to one peer, on a kernel
without netem (``sch_netem``) or fq (the qdisc that honours the departure times an eBPF
program could stamp), as on this project's development VM, whose only qdiscs are tbf,
htb and fifo.

The host's route to the peer goes through a TUN device; this relay, running in the
host's network namespace, reads each packet from it, holds it ``delay_ms`` and sends it
on from the host's own interface (a raw IP socket bound to ``eth0``, whose route to the
peer is the bridge's). The peer's packets back reach the host directly, so every round
trip between the two gains ``delay_ms``, as with a netem delay on that host's interface.
A user-space relay handles a few thousand packets a second: enough for the requests and
ACKs a reader sends to a store, not for bulk data; keep the bulk direction (the peer's)
on the bridge, shaped with tbf.

    python tests/harness/delaylink.py PEER_ADDR OWN_ADDR DELAY_MS [--dev dly0]

prints ``ready`` once the route is in place; stopped by a signal.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import select
import socket
import struct
import subprocess
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
SO_BINDTODEVICE = 25


class Held:
    """Packets held until they are due: a FIFO, as the delay is the same for each."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()

    def put(self, packet: bytes, now: float) -> None:
        self.queue.append((now + self.delay_s, packet))

    def due(self, now: float) -> list[bytes]:
        out = []
        while self.queue and self.queue[0][0] <= now:
            out.append(self.queue.popleft()[1])
        return out

    def wait(self, now: float) -> float | None:
        """Seconds until the next packet is due (None: none held)."""
        return max(0.0, self.queue[0][0] - now) if self.queue else None


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def open_tun(dev: str, peer: str, own: str) -> int:
    """The TUN device ``dev``, up, with the route to ``peer`` through it."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI))
    _sh("ip", "link", "set", dev, "up")
    _sh("ip", "route", "add", f"{peer}/32", "dev", dev, "src", own)
    # the peer's answers arrive on eth0, not on the route's device: accept them
    for conf in ("all", "default", "eth0", dev):
        _sh("sysctl", "-q", "-w", f"net.ipv4.conf.{conf}.rp_filter=0")
    return fd


def relay(fd: int, out: socket.socket, peer: str, held: Held) -> None:
    while True:
        ready, _, _ = select.select([fd], [], [], held.wait(time.monotonic()))
        now = time.monotonic()
        if ready:
            while True:
                try:
                    held.put(os.read(fd, 65536), now)
                except BlockingIOError:
                    break
        for packet in held.due(time.monotonic()):
            try:
                out.sendto(packet, (peer, 0))
            except OSError:  # a full queue below: lost, as on a real link
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer")
    parser.add_argument("own")
    parser.add_argument("delay_ms", type=float)
    parser.add_argument("--dev", default="dly0")
    args = parser.parse_args()
    fd = open_tun(args.dev, args.peer, args.own)
    out = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    out.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, b"eth0")  # not back into the TUN
    print("ready", flush=True)
    relay(fd, out, args.peer, Held(args.delay_ms / 1000))


if __name__ == "__main__":
    main()
