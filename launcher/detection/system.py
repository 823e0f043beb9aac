"""Machine checks with I/O: /dev/shm, the output folder, network, DNS.

The plan is pure; these are the side-effecting checks the ``train`` command runs
before it starts workers and that ``doctor`` reports.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path

from launcher.detection.hardware import Finding
from train.core.machine.host import OUTPUT_DIR_FIX, output_dir_problem

GIB = 1024 ** 3
SHM_MIN_BYTES = GIB
SHM_FIX = ("docker run --shm-size=8g ... (or --ipc=host); Kubernetes: mount an emptyDir "
           "{medium: Memory, sizeLimit: 8Gi} at /dev/shm")


def shm_bytes(path: str = "/dev/shm") -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def check_shm(path: str = "/dev/shm") -> Finding:
    size = shm_bytes(path)
    if size is None:
        return Finding("warn", "shm", f"{path} is missing: DataLoader workers cannot share "
                       "memory", SHM_FIX)
    text = f"{path} is {size / GIB:.2f} GiB"
    if size < SHM_MIN_BYTES:
        return Finding("warn", "shm", f"{text}: below 1 GiB, DataLoader workers can die with "
                       "'Bus error'", SHM_FIX)
    return Finding("ok", "shm", text)


def check_output_dir(path: str | Path, create: bool) -> Finding:
    """Writable? With create=False nothing is written (doctor, --dry-run)."""
    problem = output_dir_problem(path, create)
    if problem:
        return Finding("fail", "output", problem, OUTPUT_DIR_FIX, 3)
    return Finding("ok", "output", f"output.dir {path} is writable")


def interfaces() -> list[dict[str, str | None]]:
    """Network interfaces with their IPv4 address (Linux ioctl; None when it has none)."""
    out = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return out
    for name in names:
        out.append({"name": name, "ipv4": _ipv4(name)})
    return out


def _ipv4(name: str) -> str | None:
    try:
        import fcntl
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError):
        return None


def resolve(host: str) -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None)})
    except (OSError, UnicodeError):
        return []


def wait_for_host(host: str, timeout_s: float, log: Callable[[str], None],
                  sleep: Callable[[float], None] = time.sleep,
                  resolver: Callable[[str], list[str]] = resolve) -> list[str]:
    """Wait until ``host`` resolves (pytorch#73682: peers' DNS names appear late)."""
    from train.core.errors import CannotRunHere
    deadline = time.monotonic() + timeout_s
    delay, said = 1.0, False
    while True:
        addrs = resolver(host)
        if addrs:
            if said:
                log(f"rendezvous host {host} resolves to {', '.join(addrs)}")
            return addrs
        if time.monotonic() >= deadline:
            raise CannotRunHere(
                f"rendezvous host {host!r} did not resolve within {timeout_s:.0f} s: check the "
                "Service name and namespace, that the rendezvous Deployment is running, and "
                f"DNS from this pod (getent hosts {host}); TRAIN_DNS_WAIT_S sets the wait")
        if not said:
            log(f"waiting up to {timeout_s:.0f} s for rendezvous host {host} to resolve")
            said = True
        sleep(delay)
        delay = min(delay * 1.5, 5.0)


def loopback_name() -> tuple[str, str] | None:
    """(hostname, address) when this host's name resolves to a loopback address."""
    import ipaddress
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        return None
    return (name, addr) if ipaddress.ip_address(addr).is_loopback else None


NAMED_PORTS = range(29000, 30000)  # torchrun's defaults (29400, 29500) and their neighbours
LOWEST_PORT = 20000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on now, for a server that binds it later
    (torchrun's, seconds later on a loaded host).

    ``bind(0)`` would hand out one of the kernel's ephemeral ports, the range every
    outgoing connection on the host takes its local port from: one could take it before
    the server binds ("address already in use"). A port below that range is taken only
    by a program that names it; torchrun's default ports are left to those who name them.
    """
    top = _ephemeral_start()
    candidates = [p for p in range(LOWEST_PORT, top) if p not in NAMED_PORTS]
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # nothing free below
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
