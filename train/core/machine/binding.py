"""Store servers listen where their clients are told to connect, not on every interface.

torch's ``TCPStore`` server listens on every interface whatever host name it is given
(``ss -ltn`` shows ``*:PORT``): torchrun's rendezvous store, the store the workers'
process group meets at, and the standalone ``rendezvous`` command's store. Anyone who
reaches the port can read and write the job's keys, and torchrun's agent unpickles one
of them (see :mod:`launcher.liveness.rdzv_state`). TCPStore accepts a socket that is already
listening (``master_listen_fd``, with both its backends): here the project binds that
socket itself and hands it over, so the bind is real.

Where: the address the store's host name resolves to on this machine, when that is one
of the machine's own (a bind there succeeds). That is exactly what the clients connect
to, so nothing that worked before stops working. Two cases keep torch's every
interface, each said in one line by the caller:

- the name is an address of another machine (a NAT, a load balancer in front);
- a name that is not a loopback name resolves to loopback here (``127.0.1.1 host`` in
  Debian's /etc/hosts) while other machines may resolve it to the node's real address.

Clients, in the workers (``wait_for_server``): torch's client retries a refused
connection only after a backoff of about a second, and a worker of rank 1 is often
there before rank 0 (which hosts the process group's store when torchrun's agent does
not share its own, as under the launcher) listens. Measured on torch 2.13 with two
workers on one machine: rank 1 joined 1.0-1.4 s after rank 0 listened, whenever it
had asked first. Here a client first polls the port every :data:`POLL_S` (a plain connect,
closed at once: the server takes it for a client that left) and is built once the port
accepts, within the store's own timeout; a server that never comes gets torch's client
with what is left of that timeout, so its error is torch's, as late as before.

Torch-free: the launcher's torchrun agent and the workers each give :func:`install` the
``TCPStore`` class of their torch.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import socket
import time
from collections.abc import Callable, Iterable
from types import ModuleType

WILDCARDS = frozenset({"", "*"})  # every interface, in both families (0.0.0.0: IPv4's)
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
BACKLOG = 4096  # what torch's own listener asks for
# TCPStore's constructor arguments, in its positional order (torch 2.x).
_STORE_ARGS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers",
               "multi_tenant", "master_listen_fd", "use_libuv")
POLL_S = 0.02  # how often a client tries a store server not listening yet
RESOLVE_EVERY_S = 1.0  # and looks its name up again


def _is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return True
    except ValueError:
        return False


def _open(family: int, address: tuple) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch does
        if family == socket.AF_INET6 and address[0] == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # both families
        sock.bind(address)
        sock.listen(BACKLOG)
        return sock
    except OSError:
        sock.close()
        raise


def _candidates(host: str, port: int, exact: bool) -> tuple[list[tuple[int, tuple]], str | None]:
    """The addresses to try, in the resolver's order; a note when none of the host's may
    be used (then the wildcard only)."""
    if host.strip("[]") in WILDCARDS:
        return [], None
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return [], f"{host} does not resolve here"
    found = [(family, address) for family, _, _, _, address in infos]
    loopback_name = host.lower() in LOOPBACK_NAMES or _is_literal(host.strip("[]"))
    if exact or loopback_name:
        return found, None
    # a host name: its loopback addresses here are not what the other machines reach
    reachable = [(family, a) for family, a in found if not _is_loopback(a[0])]
    if not reachable:
        return [], (f"{host} resolves to {found[0][1][0]} on this machine, which other "
                    "machines cannot reach")
    return reachable, None


def listener(host: str, port: int, exact: bool = False) -> tuple[socket.socket, str | None]:
    """A socket listening for a store named ``host:port`` (port 0: any free one), and,
    when it listens on every interface although a host was named, why.

    exact: the operator named the address (``rendezvous --host``): bind what it resolves
    to, loopback included, and never fall back to every interface (OSError instead).
    Raises OSError when the port is taken (or the wildcard cannot be bound either)."""
    found, note = _candidates(host, port, exact)
    for family, address in found:
        try:
            return _open(family, (address[0], port, *address[2:])), None
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL or exact:  # taken, or asked for: say so
                raise
    if found:
        note = f"{host} is not an address of this machine"
    if note and exact:
        raise OSError(errno.EADDRNOTAVAIL, note)
    return _wildcard(port), note


def _wildcard(port: int) -> socket.socket:
    """Every interface, both families where the kernel has IPv6 (as torch listens)."""
    if socket.has_ipv6:
        try:
            return _open(socket.AF_INET6, ("::", port))
        except OSError as exc:
            if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
    return _open(socket.AF_INET, ("0.0.0.0", port))


def store_arguments(args: tuple, kwargs: dict) -> dict:
    """TCPStore's arguments by name, however they were passed."""
    return {**dict(zip(_STORE_ARGS[:len(args)], args, strict=True)), **kwargs}


def bound_store_class(base: type, say: Callable[[str], None],
                      wait_for_server: bool = False) -> type:
    """A stand-in for torch's ``TCPStore`` class that builds a ``TCPStore`` whose server
    listens on a socket bound by :func:`listener` (clients, and stores given a socket,
    are built as they were asked; with ``wait_for_server``, a client once its server's
    port accepts: :func:`client_when_listening`). What it builds is a ``base``, and an
    instance of the stand-in too, so ``isinstance(store, torch.distributed.TCPStore)``
    still holds."""

    class Meta(type(base)):  # type: ignore[misc]
        """What the stand-in builds is a ``base``: ``isinstance`` says so both ways."""

        def __instancecheck__(cls, instance) -> bool:
            return isinstance(instance, base)

        def __subclasscheck__(cls, subclass) -> bool:
            return issubclass(subclass, base)

    class BoundTCPStore(base, metaclass=Meta):  # type: ignore[misc, valid-type]
        __doc__ = base.__doc__

        # __new__ returns a finished base instance (so __init__ is not called again): no
        # half-built C++ object is left behind when torch's constructor raises
        def __new__(cls, *args, **kwargs):
            named = store_arguments(args, kwargs)
            if named.get("is_master") and named.get("master_listen_fd") is None:
                named.update(_bound_server(str(named["host_name"]), int(named["port"]), say))
            elif wait_for_server and not named.get("is_master"):
                return client_when_listening(base, named)
            return base(**named)

    BoundTCPStore.__name__ = BoundTCPStore.__qualname__ = "TCPStore"
    return BoundTCPStore


def client_when_listening(base: type, named: dict):
    """A client ``base(**named)``, built once its server's port accepts a connection
    (polled every POLL_S, within the store's timeout; the module docstring says why).
    Without a timeout among the arguments (torch's default applies), built at once."""
    timeout = named.get("timeout")
    if not isinstance(timeout, datetime.timedelta):
        return base(**named)
    deadline = time.monotonic() + timeout.total_seconds()
    if listening(str(named["host_name"]), int(named["port"]), deadline):
        return base(**named)
    # never came: torch's own connect, with the rest of the timeout (at least a second)
    left = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
    store = base(**{**named, "timeout": left})
    store.set_timeout(timeout)  # later waits and gets keep the store's own timeout
    return store


def listening(host: str, port: int, deadline: float) -> bool:
    """Whether ``host:port`` accepts a TCP connection before the monotonic ``deadline``.
    The name is looked up again at most every RESOLVE_EVERY_S (a pod's name may resolve
    only once it runs), not at each try: many workers polling must not flood the DNS."""
    addresses: list[tuple[int, tuple]] = []
    resolved_at = -float("inf")
    while True:
        if time.monotonic() - resolved_at >= RESOLVE_EVERY_S:
            addresses, resolved_at = _addresses(host, port), time.monotonic()
        wait = max(0.1, min(deadline - time.monotonic(), 1.0))
        if any(_accepts(family, address, wait) for family, address in addresses):
            return True
        if deadline - time.monotonic() <= POLL_S:
            return False
        time.sleep(POLL_S)


def _addresses(host: str, port: int) -> list[tuple[int, tuple]]:
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return [(family, address) for family, _, _, _, address in infos]


def _accepts(family: int, address: tuple, timeout: float) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(address)
        except OSError:
            return False
    return True


def _bound_server(host: str, port: int, say: Callable[[str], None]) -> dict:
    """The port and listening socket for a store server named host:port."""
    try:
        sock, note = listener(host, port)
    except OSError as exc:  # as torch raises it for a port in use
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    if note:
        say(f"store {host}:{sock.getsockname()[1]} listens on every interface: {note}")
    return {"port": sock.getsockname()[1],
            "master_listen_fd": sock.detach()}  # the store owns (and closes) it


def install(distributed: ModuleType, users: Iterable[ModuleType],
            say: Callable[[str], None], wait_for_server: bool = False) -> type:
    """Make ``distributed.TCPStore`` (``torch.distributed``) and each module in ``users``
    that imported it by name (torchrun's rendezvous backends, ``init_process_group``'s
    ``env://``: pass ``sys.modules.values()`` once they are imported) create bound
    servers (and, ``wait_for_server``, clients once their server listens); returns the
    class. Idempotent."""
    current = distributed.TCPStore
    if getattr(current, "_bound", False):
        return current
    bound = bound_store_class(current, say, wait_for_server)
    bound._bound = True
    distributed.TCPStore = bound
    for module in list(users):
        if not getattr(module, "__name__", "").startswith("torch._C") and \
                getattr(module, "TCPStore", None) is current:
            module.TCPStore = bound
    return bound
