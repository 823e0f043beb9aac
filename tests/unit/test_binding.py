"""Store servers listen where their clients connect (train/core/machine/binding.py), measured on
the real sockets: torch's TCPStore given a socket the project bound, the standalone
``rendezvous --host`` store, and the allow-list that reads torch's rendezvous state.
The end-to-end half (whole runs, nodes in network namespaces, a pickle written to a
running job's store) is tests/e2e/test_binding_runs.py.
"""

from __future__ import annotations

import datetime
import errno
import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys

import pytest

from tests.harness.runs import ENTRY, clean_env, limit, read_until
from tests.harness.sockets import listening
from train.core.machine import binding

NOT_HERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never an address of this machine


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=limit(10))


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_store_named_by_a_loopback_address_listens_there_only(host):
    sock, note = binding.listener(host, 0)
    with sock:
        address, port = sock.getsockname()[:2]
        assert note is None and binding._is_loopback(address)
        mine = [s for s in listening([os.getpid()]) if s.port == port]
        assert len(mine) == 1 and mine[0].loopback and not mine[0].wildcard


def test_a_name_of_another_machine_keeps_every_interface_and_says_why():
    sock, note = binding.listener(NOT_HERE, 0)
    with sock:
        assert note == f"{NOT_HERE} is not an address of this machine"
        port = sock.getsockname()[1]
        assert [s.wildcard for s in listening([os.getpid()]) if s.port == port] == [True]


def test_a_host_name_that_resolves_to_loopback_here_keeps_every_interface(monkeypatch):
    # Debian's "127.0.1.1 HOST": the other nodes may know HOST by its real address
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *args, **kwargs: real(
        "127.0.1.1" if host == "node7" else host, *args, **kwargs))
    sock, note = binding.listener("node7", 0)
    with sock:
        assert note == "node7 resolves to 127.0.1.1 on this machine, which other machines " \
                       "cannot reach"
        port = sock.getsockname()[1]
        assert [s.wildcard for s in listening([os.getpid()]) if s.port == port] == [True]
    with binding.listener("node7", 0, exact=True)[0] as asked:  # named by the operator
        assert asked.getsockname()[0] == "127.0.1.1"


def test_an_operator_named_address_is_bound_exactly_or_refused():
    with pytest.raises(OSError) as refused:
        binding.listener(NOT_HERE, 0, exact=True)
    assert refused.value.errno == errno.EADDRNOTAVAIL
    with binding.listener("127.0.0.1", 0)[0] as taken, pytest.raises(OSError) as busy:
        binding.listener("127.0.0.1", taken.getsockname()[1], exact=True)
    assert busy.value.errno == errno.EADDRINUSE


def test_torch_store_servers_bind_the_address_they_are_named_by(monkeypatch):
    import torch.distributed as dist
    env_rendezvous = importlib.import_module("torch.distributed.rendezvous")  # env://
    original = dist.TCPStore
    monkeypatch.setattr(dist, "TCPStore", original)
    monkeypatch.setattr(env_rendezvous, "TCPStore", original)
    said: list[str] = []
    bound = binding.install(dist, list(sys.modules.values()), said.append)
    assert dist.TCPStore is bound and env_rendezvous.TCPStore is bound
    assert binding.install(dist, [], said.append) is bound  # once is enough
    # positionally, as torchrun's static rendezvous calls it
    server = dist.TCPStore("127.0.0.1", 0, 1, True, _timeout(), multi_tenant=True)
    assert isinstance(server, original) and isinstance(server, bound)
    mine = [s for s in listening([os.getpid()]) if s.port == server.port]
    assert len(mine) == 1 and str(mine[0].address) == "127.0.0.1", mine
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=_timeout())
    client.set("k", "v")
    assert server.get("k") == b"v" and said == []


def test_a_client_started_before_its_server_is_built_once_the_port_listens():
    """The workers' clients poll a server that is not there yet (torch's own retry waits
    about a second) and torch's client is built once it listens, with the store's own
    timeout."""
    import threading
    import time

    import torch.distributed as dist
    port = _free_port()
    servers: list = []

    def serve_soon() -> None:
        time.sleep(0.3)  # the client polls by then (and if not, what is asserted holds)
        servers.append(dist.TCPStore("127.0.0.1", port, 2, True, _timeout(),
                                     wait_for_workers=False))

    built_while_listening: list[bool] = []

    def torch_client(**named):
        built_while_listening.append(_accepts("127.0.0.1", port))
        return dist.TCPStore(**named)

    thread = threading.Thread(target=serve_soon)
    thread.start()
    try:
        client = binding.client_when_listening(torch_client, {
            "host_name": "127.0.0.1", "port": port, "world_size": 2, "is_master": False,
            "timeout": _timeout()})
    finally:
        thread.join()
    assert built_while_listening == [True] and client.timeout == _timeout()
    client.set("k", "v")
    assert servers[0].get("k") == b"v"


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:  # nothing listens on it once closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_client_whose_server_never_comes_fails_as_torch_says_it():
    """Its timeout spent polling, torch's own client still says why (with the rest of
    the timeout, at least a second), and the bound class builds it too."""
    import torch.distributed as dist
    bound = binding.bound_store_class(dist.TCPStore, print, wait_for_server=True)
    with pytest.raises(dist.DistNetworkError):
        bound("127.0.0.1", _free_port(), 2, False, datetime.timedelta(seconds=2))


def test_a_store_whose_port_is_taken_fails_as_torch_says_it():
    import torch.distributed as dist
    bound = binding.bound_store_class(dist.TCPStore, print)
    with socket.create_server(("127.0.0.1", 0)) as taken, \
            pytest.raises(RuntimeError, match=r"cannot listen on 127\.0\.0\.1:.*in use"):
        bound("127.0.0.1", taken.getsockname()[1], is_master=True, timeout=_timeout())


def _serve(tmp_path, *args: str) -> tuple[subprocess.Popen, str, int]:
    proc = subprocess.Popen([sys.executable, ENTRY, "rendezvous", "--port", "0", *args],
                            cwd=tmp_path, env=clean_env(), stderr=subprocess.PIPE, text=True)
    found = read_until(proc, r"listening on (\S+):(\d+);", timeout=limit(60))
    return proc, found[1], int(found[2])


@pytest.mark.parametrize("host, shown, wildcard", [("127.0.0.1", "127.0.0.1", False),
                                                   ("0.0.0.0", "0.0.0.0", True)])
def test_rendezvous_listens_on_the_host_it_is_given_and_says_it(tmp_path, host, shown,
                                                                 wildcard):
    proc, said, port = _serve(tmp_path, "--host", host)
    try:
        sockets = listening([proc.pid])
        assert said == shown and [(s.address, s.port) for s in sockets] == [(shown, port)]
        assert sockets[0].wildcard is wildcard
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=limit(30)) == 0


def test_rendezvous_refuses_an_address_of_another_machine(tmp_path):
    out = subprocess.run([sys.executable, ENTRY, "rendezvous", "--host", NOT_HERE],
                         cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                         timeout=limit(60))
    assert out.returncode == 2 and "not an address of this machine" in out.stderr


# ---------------------------------------------------------- the rendezvous state


def _state():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
    state, node = rdzv._RendezvousState(), rdzv._NodeDesc("10.0.0.1", 12, 3)
    state.participants[node] = 0
    state.wait_list.add(node)
    state.last_heartbeats[node] = datetime.datetime.now(datetime.UTC)
    state.deadline = datetime.datetime.now(datetime.UTC)
    return state, {"_RendezvousState": rdzv._RendezvousState, "_NodeDesc": rdzv._NodeDesc}


@pytest.mark.parametrize("protocol", range(3, pickle.HIGHEST_PROTOCOL + 1))
def test_the_agent_reads_torch_s_own_state_as_torch_does(protocol):
    from launcher.liveness.rdzv_state import load_state
    state, classes = _state()
    read = load_state(pickle.dumps(state, protocol=protocol), classes)
    assert type(read) is type(state) and vars(read) == vars(state)


class _Touch:
    """A pickle that creates a file when loaded."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_the_agent_refuses_any_other_pickle(tmp_path):
    from launcher.liveness.rdzv_state import load_state
    _, classes = _state()
    marker = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        load_state(pickle.dumps(_Touch(marker)), classes)
    assert not marker.exists()
    pickle.loads(pickle.dumps(_Touch(marker)))  # what plain pickle would have done
    assert marker.exists()
