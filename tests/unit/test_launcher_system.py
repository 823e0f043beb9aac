"""Machine checks and the rendezvous state reader, without the machine."""

from __future__ import annotations

import base64
import datetime
import os
import pickle

import pytest

from launcher.commands import rendezvous
from launcher.detection import system
from train.core.errors import CannotRunHere


def test_dns_wait_retries_then_succeeds():
    answers = iter([[], [], ["10.0.0.5"]])
    slept, logged = [], []
    addrs = system.wait_for_host("rdzv.ns.svc", 60, logged.append, sleep=slept.append,
                                 resolver=lambda host: next(answers))
    assert addrs == ["10.0.0.5"] and len(slept) == 2
    assert logged[0].startswith("waiting up to 60 s for rendezvous host rdzv.ns.svc")
    assert logged[-1] == "rendezvous host rdzv.ns.svc resolves to 10.0.0.5"


def test_dns_wait_gives_up_with_exit_3():
    with pytest.raises(CannotRunHere) as err:
        system.wait_for_host("nope.invalid", 0, lambda m: None, sleep=lambda s: None,
                             resolver=lambda host: [])
    assert err.value.exit_code == 3 and "getent hosts nope.invalid" in str(err.value)


def test_localhost_resolves():
    assert "127.0.0.1" in system.resolve("localhost")


@pytest.mark.parametrize("size, level", [(64 * 1024 ** 2, "warn"), (8 * 1024 ** 3, "ok"),
                                         (None, "warn")])
def test_shm_check(monkeypatch, size, level):
    monkeypatch.setattr(system, "shm_bytes", lambda path="/dev/shm": size)
    found = system.check_shm()
    assert found.level == level
    if size and level == "warn":
        assert "0.06 GiB" in found.message and "--shm-size" in found.fix
        assert "medium: Memory" in found.fix


def test_output_dir_check_writes_nothing_unless_asked(tmp_path):
    target = tmp_path / "a" / "b"
    assert system.check_output_dir(target, create=False).level == "ok"
    assert not (tmp_path / "a").exists()
    assert system.check_output_dir(target, create=True).level == "ok"
    assert target.is_dir() and os.listdir(target) == []


def test_output_dir_under_a_file_fails_with_exit_3(tmp_path):
    (tmp_path / "f").write_text("x")
    for create in (False, True):
        found = system.check_output_dir(tmp_path / "f" / "runs", create=create)
        assert found.level == "fail" and found.exit_code == 3 and found.fix


def test_interfaces_include_loopback():
    assert any(i["name"] == "lo" and i["ipv4"] == "127.0.0.1" for i in system.interfaces())


def _state(participants: dict, waiting=(), closed=False) -> bytes:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState
    s = _RendezvousState()
    s.round, s.complete, s.closed = 1, True, closed
    for (addr, pid), rank in participants.items():
        node = _NodeDesc(addr, pid, 0)
        s.participants[node] = rank
        s.last_heartbeats[node] = datetime.datetime.now(datetime.UTC)
    s.wait_list = {_NodeDesc(a, p, 0) for a, p in waiting}
    return base64.b64encode(pickle.dumps(s))


def test_a_free_port_is_one_no_outgoing_connection_takes_and_never_one_in_use(monkeypatch):
    import socket
    start = system._ephemeral_start()
    for _ in range(20):
        port = system.free_port()
        assert system.LOWEST_PORT <= port < start and port not in system.NAMED_PORTS
    def bindable(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False
    busy = next(p for p in (system.free_port() for _ in range(100))
                if p + 1 not in system.NAMED_PORTS and bindable(p + 1))
    with socket.socket() as taken:  # of two candidates, the one in use is never chosen
        taken.bind(("127.0.0.1", busy))
        monkeypatch.setattr(system, "LOWEST_PORT", busy)
        monkeypatch.setattr(system, "_ephemeral_start", lambda: busy + 2)
        assert {system.free_port() for _ in range(10)} == {busy + 1}
        monkeypatch.setattr(system, "_ephemeral_start", lambda: busy + 1)
        assert system.free_port() != busy  # none free below: the kernel's own pick


def test_rendezvous_state_summary():
    raw = _state({("10.0.0.2", 7): 1, ("10.0.0.1", 9): 0}, waiting=[("10.0.0.3", 4)])
    assert rendezvous.describe(raw) == ("round 1 complete: 2 node(s) [10.0.0.1:9 rank 0, "
                                        "10.0.0.2:7 rank 1]; waiting to join: 10.0.0.3:4")
    assert rendezvous.describe(_state({}, closed=True)).endswith(
        "closed (a new job needs a new run id)")


def test_node_names_cannot_forge_log_lines():
    raw = _state({("evil\nentrypoint: forged line\x1b[31m", 7): 0})
    summary = rendezvous.describe(raw)
    assert "\n" not in summary and "\x1b" not in summary
    assert "evil\\nentrypoint: forged line\\x1b[31m:7" in summary


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/pwned-by-rendezvous",))


def test_rendezvous_reader_never_builds_other_classes():
    assert rendezvous.describe(base64.b64encode(pickle.dumps(Evil()))) is None
    assert rendezvous.describe(b"not base64 !!") is None
    assert not os.path.exists("/tmp/pwned-by-rendezvous")


def test_watch_logs_only_changes():
    class Store:
        value = _state({("h", 1): 0})

        def list_keys(self):
            return ["torch.rendezvous.job", "torch.rendezvous.job.extra", "other"]

        def get(self, key):
            return self.value

    store, seen, logged = Store(), {}, []
    rendezvous.watch(store, seen, logged.append)
    rendezvous.watch(store, seen, logged.append)
    assert logged == ["run 'job': round 1 complete: 1 node(s) [h:1 rank 0]"]
    store.value = _state({("h", 1): 0, ("g", 2): 1})
    rendezvous.watch(store, seen, logged.append)
    assert len(logged) == 2 and "2 node(s)" in logged[1]
