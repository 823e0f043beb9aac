"""The TCP sockets a process tree listens on, read from /proc (no ``ss`` needed).

A listening socket is a line of ``/proc/PID/net/tcp`` or ``tcp6`` in state 0A; which
process holds it is told by its inode, among the ``socket:[INODE]`` links of
``/proc/PID/fd``. The net files are read through each process, so a process in a
network namespace is seen in its own.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"


@dataclass(frozen=True, order=True)
class Listener:
    address: str       # "127.0.0.1", "::", "0.0.0.0", ...
    port: int
    pid: int

    @property
    def wildcard(self) -> bool:
        return ipaddress.ip_address(self.address).is_unspecified

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return (mapped or ip).is_loopback

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port} (pid {self.pid})"


def _address(hex_addr: str) -> tuple[str, int]:
    """'0100007F:1F90' -> ('127.0.0.1', 8080); IPv6 as four little-endian words."""
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(packed)), int(port, 16)


def _listening_inodes(pid: int) -> dict[int, tuple[str, int]]:
    out = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == LISTEN:
                out[int(f[9])] = _address(f[1])
    return out


def _socket_inodes(pid: int) -> set[int]:
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(int(link[8:-1]))
    return found


def listening(pids) -> list[Listener]:
    """Every TCP socket the given processes listen on."""
    out = set()
    for pid in pids:
        table = _listening_inodes(pid)
        for inode in _socket_inodes(pid) & table.keys():
            out.add(Listener(*table[inode], pid))
    return sorted(out)
