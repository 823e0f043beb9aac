"""Hosts on a network of their own: each a network, PID, UTS and mount namespace, all on
one bridge, so that a host can *vanish* the way a machine does on power loss or a
partition (its link goes down: no FIN, no RST, its processes live on) and come back.

The bridge and every host live in network namespaces this harness creates and deletes
(``ip netns``), in the range set aside for benchmarking, 198.18.0.0/24 (RFC 2544): no
packet leaves this machine. A host sees the others by name (its own /etc/hosts, bind
mounted in its mount namespace) and has its own hostname. Needs root (or
CAP_NET_ADMIN + CAP_SYS_ADMIN); :func:`available` says why not, for a skip.

Beside tests/harness/multinode.py (simulated nodes on 127.0.0.1 in PID namespaces): that one
shows what a process dying does; this one what a host disappearing does.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

from tests.harness.multinode import Process

SUBNET = "198.18.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """None when this machine can make such hosts, else why not."""
    name = f"trn-probe-{uuid.uuid4().hex[:6]}"
    try:
        made = _ip("netns", "add", name, check=False)
    except FileNotFoundError:
        return "no `ip` command (iproute2)"
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    probe = subprocess.run(["unshare", "--pid", "--fork", "--uts", "--mount", "true"],
                           capture_output=True, text=True)
    if probe.returncode:
        return f"cannot create PID/UTS/mount namespaces: {probe.stderr.strip()}"
    return None


class Host:
    """One machine: its namespace, its address, its name."""

    def __init__(self, net: Network, name: str, index: int) -> None:
        self.net, self.name, self.index = net, name, index
        self.netns = f"{net.prefix}-{name}"
        self.addr = f"{SUBNET}.{index}"
        self.port = f"{net.prefix}-p{index}"     # its end on the bridge

    def wrap(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--pid", "--fork",
                "--kill-child", "--uts", "--mount-proc", "sh", "-c",
                f'hostname {self.name} && mount --bind "{self.net.hosts}" /etc/hosts && '
                'exec "$@"', "sh"]

    def process(self, label: str, argv: list[str], env: dict, cwd: Path) -> Process:
        return Process(f"{self.name}-{label}", argv, env, cwd, wrap=self.wrap())


class Network:
    """A bridge and the hosts on it; :meth:`close` deletes every namespace it made."""

    def __init__(self, work: Path) -> None:
        self.prefix = f"trn{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = work / "etc-hosts"
        self.hosts.write_text("127.0.0.1 localhost\n")
        self.members: list[Host] = []
        self.aliases: dict[str, Host] = {}  # more names of a host (a Service's name)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def host(self, name: str) -> Host:
        h = Host(self, name, len(self.members) + 1)
        _ip("netns", "add", h.netns)
        _ip("link", "add", "eth0", "netns", h.netns, "type", "veth", "peer", "name", h.port,
            "netns", self.switch)
        _ip("-n", self.switch, "link", "set", h.port, "master", "br0")
        _ip("-n", self.switch, "link", "set", h.port, "up")
        _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
        _ip("-n", h.netns, "link", "set", "eth0", "up")
        _ip("-n", h.netns, "link", "set", "lo", "up")
        self.members.append(h)
        self._write_hosts()
        return h

    def alias(self, name: str, host: Host) -> None:
        """``name`` resolves to ``host``'s address on every host from now on."""
        self.aliases[name] = host
        self._write_hosts()

    def _write_hosts(self) -> None:
        # rewritten in place: the hosts' bind mounts of this file see the new text
        self.hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"{m.addr} {m.name}{''.join(' ' + a for a, h in self.aliases.items() if h is m)}\n"
            for m in self.members))

    def hanging_nameserver(self, host: Host) -> None:
        """Name lookups that go to the nameserver hang instead of failing at once (as on
        air-gapped and HPC nodes whose resolver never answers): every address off the
        bridge is on its link, where no one answers the neighbour query. Names in
        /etc/hosts still resolve at once."""
        _ip("-n", host.netns, "route", "add", "default", "dev", "eth0")

    def cut(self, host: Host) -> None:
        """The host vanishes from the network: its link goes down, nothing is sent."""
        _ip("-n", self.switch, "link", "set", host.port, "down")

    def heal(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", host.port, "up")

    def partition(self, a: Host, b: Host) -> None:
        """``a`` and ``b`` lose each other (a blackhole route each way: what they send the
        other is dropped, nothing is refused) while both still reach every other host."""
        _ip("-n", a.netns, "route", "add", "blackhole", f"{b.addr}/32")
        _ip("-n", b.netns, "route", "add", "blackhole", f"{a.addr}/32")

    def unpartition(self, a: Host, b: Host) -> None:
        _ip("-n", a.netns, "route", "del", "blackhole", f"{b.addr}/32", check=False)
        _ip("-n", b.netns, "route", "del", "blackhole", f"{a.addr}/32", check=False)

    def slow_link(self, host: Host, delay_ms: int = 100, rate: str = "50mbit") -> str:
        """Everything ``host`` sends is held back on its interface (tc, in its namespace):
        a slow NIC or a congested port on that host's side of every link it has. A netem
        delay of ``delay_ms``; on a kernel without netem (sch_netem not built, as on this
        project's development VM), a token bucket at ``rate``: a NIC that negotiated a
        lower speed. Returns the qdisc used; :meth:`fast_link` removes it."""
        netem = self.tc(host, "qdisc", "add", "dev", "eth0", "root", "netem", "delay",
                         f"{delay_ms}ms")
        if netem.returncode == 0:
            return f"netem delay {delay_ms}ms"
        if "unknown" not in netem.stderr.lower():
            raise RuntimeError(f"tc netem on {host.name}: {netem.stderr.strip()}")
        tbf = self.tc(host, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
                       "burst", "32kbit", "latency", "100ms")
        if tbf.returncode:
            raise RuntimeError(f"tc tbf on {host.name}: {tbf.stderr.strip()}")
        return f"tbf rate {rate} (no netem in this kernel)"

    def sysctl(self, host: Host, setting: str) -> None:
        """A network setting of ``host``'s own namespace (``net.ipv4.tcp_wmem=...``)."""
        subprocess.run(["nsenter", f"--net=/run/netns/{host.netns}", "sysctl", "-q", "-w",
                        setting], check=True, capture_output=True, text=True)

    def fast_link(self, host: Host) -> None:
        self.tc(host, "qdisc", "del", "dev", "eth0", "root")

    def tc(self, host: Host, *args: str) -> subprocess.CompletedProcess:
        """``tc ARGS`` in ``host``'s namespace (not checked: the caller reads the answer)."""
        return subprocess.run(["nsenter", f"--net=/run/netns/{host.netns}", "tc", *args],
                              capture_output=True, text=True)

    def close(self) -> None:
        for h in self.members:
            _ip("netns", "del", h.netns, check=False)
        _ip("netns", "del", self.switch, check=False)


class Rig:
    """Hosts on a network of their own and the processes started on them, as a ``with``
    block: on the way out, whatever ends it (an error, Ctrl-C, a SIGTERM the caller turns
    into SystemExit), each process is killed with its PID namespace and every namespace
    deleted. The network is made inside the block (:meth:`network`), so that a failure
    while making its hosts deletes what was made."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[Process] = []
        self.net: Network | None = None

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def network(self) -> Network:
        if self.net is None:
            self.net = Network(self.work)
        return self.net

    def run(self, host: Host, label: str, argv: list[str], env: dict) -> Process:
        """``argv`` started on ``host``; killed when the rig closes."""
        p = host.process(label, argv, env, self.work)
        self.procs.append(p.start())
        return p

    def close(self) -> None:
        for p in reversed(self.procs):
            p.kill()
        self.procs = []
        if self.net is not None:
            self.net.close()
            self.net = None
