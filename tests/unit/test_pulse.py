"""Slow is not dead (launcher/liveness/pulse.py): a member of an elastic round whose keep-alives
stopped but whose pulse socket still completes a handshake keeps its place until
heartbeat_silence_s; one whose pulse is gone is lost at once and marked expired in the
rendezvous state, which torch's own agents then drop. In process, with a real TCPStore,
real sockets and torch's own rendezvous state classes. The same with simulated nodes
frozen and killed: tests/e2e/test_multinode_runs.py."""

from __future__ import annotations

import base64
import datetime
import pickle
import socket
import time

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from launcher.liveness.pulse import REPROBE_S, Pulse, answers, pulse_key
from launcher.liveness.rdzv_state import read_round
from launcher.liveness.rounds import RoundWatcher
from tests.harness.runs import limit

ME, PEER = _NodeDesc("127.0.0.1", 7, 42), _NodeDesc("127.0.0.1", 9, 5)
ME_NAME, PEER_NAME = "127.0.0.1:7#42", "127.0.0.1:9#5"


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield server
    del server


def _state(store, peer_silent_s: float) -> None:
    """A complete round of two, as torchrun's agents write it, the peer silent."""
    now = datetime.datetime.now(datetime.UTC)
    state = _RendezvousState()
    state.complete = True
    state.participants = {ME: 0, PEER: 1}
    state.last_heartbeats = {ME: now, PEER: now - datetime.timedelta(seconds=peer_silent_s)}
    store.set("torch.rendezvous.job", base64.b64encode(pickle.dumps(state)))


def _watcher(store, lines: list[str], lost: list) -> RoundWatcher:
    w = RoundWatcher("127.0.0.1:1", "job", (1, 2), 600, lines.append, lost_after_s=8,
                     silence_s=20, me=":7#42",
                     on_lost=lambda nodes, why: lost.append((nodes, why)))
    w.store = store
    return w


def _look(w: RoundWatcher, store) -> None:
    w.observe(read_round(store.get("torch.rendezvous.job")))


def _torch_drops_peer(store) -> bool:
    """Does torch's own state holder (keep-alive 2 s x 10) drop the peer at its next look?"""
    settings = RendezvousSettings("job", 1, 2, RendezvousTimeout(),
                                  keep_alive_interval=datetime.timedelta(seconds=2),
                                  keep_alive_max_attempt=10)
    holder = _BackendRendezvousStateHolder(C10dRendezvousBackend(store, "job"), settings)
    holder.sync()
    return PEER not in holder.state.participants


def test_a_silent_member_whose_pulse_answers_keeps_its_place_until_the_silence_limit(store):
    pulse = Pulse("127.0.0.1")
    pulse.start()
    try:
        store.set(pulse_key("job", "9#5"), pulse.where)
        lines: list[str] = []
        lost: list = []
        w = _watcher(store, lines, lost)
        _state(store, 0)
        _look(w, store)
        _state(store, 12)  # past lost_after_s, its host answers
        _look(w, store)
        _look(w, store)
        assert lost == []
        starved = [line for line in lines if "silent for" in line]
        assert len(starved) == 1 and PEER_NAME in starved[0] and "keeps its place" in starved[0]
        assert not _torch_drops_peer(store)  # nobody touched the state
        _state(store, 21)  # past heartbeat_silence_s: frozen
        _look(w, store)
        assert [nodes for nodes, _ in lost] == [[PEER_NAME]]
        assert "heartbeat_silence_s" in lost[0][1]
    finally:
        pulse.close()


def test_a_silent_member_whose_pulse_is_gone_is_lost_at_once_and_torch_drops_it(store):
    pulse = Pulse("127.0.0.1")
    store.set(pulse_key("job", "9#5"), pulse.where)
    pulse.close()  # its process died: the port refuses
    lines: list[str] = []
    lost: list = []
    w = _watcher(store, lines, lost)
    _state(store, 0)
    _look(w, store)
    _state(store, 9)
    assert not _torch_drops_peer(store)  # 9 s is within torch's 20 s expiry
    _look(w, store)
    assert [nodes for nodes, _ in lost] == [[PEER_NAME]]
    assert "host is down or cut off" in lost[0][1]
    assert not [line for line in lines if "keeps its place" in line]
    assert read_round(store.get("torch.rendezvous.job")).silent[PEER_NAME] > 3600
    assert _torch_drops_peer(store)  # the next round need not wait for the expiry


def test_a_member_that_published_no_pulse_is_lost_as_before(store):
    lost: list = []
    w = _watcher(store, [], lost)
    _state(store, 0)
    _look(w, store)
    _state(store, 9)
    _look(w, store)
    assert [nodes for nodes, _ in lost] == [[PEER_NAME]]


def test_the_pulse_completes_handshakes_while_its_thread_does_not_run():
    """The kernel answers for a process that gets no CPU: the accepting thread is not
    started here at all, and every probe still connects."""
    pulse = Pulse("127.0.0.1")
    try:
        assert all(answers(pulse.where, "127.0.0.1") for _ in range(50))
    finally:
        pulse.close()
    assert not answers(pulse.where, "127.0.0.1")


def test_a_member_known_by_a_name_is_probed_at_its_address_and_no_answer_keeps_it():
    """A member address that is a host name is looked up within the probe's bound; a
    name with no address (or a nameserver that does not answer) is no evidence that the
    member is gone, so it keeps its place rather than being evicted by a slow DNS."""
    pulse = Pulse("127.0.0.1")
    try:
        port = pulse.where.rpartition(":")[2]
        assert answers(f":{port}", "localhost")  # the name, then the handshake
        started = time.monotonic()
        assert answers(f":{port}", "no-such-host.invalid")
        assert time.monotonic() - started < limit(5)  # bounded, whatever the resolver
    finally:
        pulse.close()
    assert not answers(f":{port}", "localhost")  # the name resolves: a refusal counts


def test_a_silent_member_that_answered_is_not_probed_again_at_every_look(store):
    """The watcher looks every half second; a member that answered is probed at most
    once per REPROBE_S (counted as handshakes on a socket nobody accepts from)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    listener.settimeout(0)
    try:
        store.set(pulse_key("job", "9#5"), f"127.0.0.1:{listener.getsockname()[1]}")
        w = _watcher(store, [], [])
        _state(store, 0)
        _look(w, store)
        _state(store, 12)
        started = time.monotonic()
        for _ in range(10):
            _look(w, store)
        elapsed = time.monotonic() - started
        handshakes = 0
        while True:
            try:
                listener.accept()[0].close()
            except BlockingIOError:
                break
            handshakes += 1
        assert 1 <= handshakes <= 1 + elapsed / REPROBE_S
    finally:
        listener.close()
