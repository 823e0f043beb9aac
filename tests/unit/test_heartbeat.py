"""The static job's heartbeat (launcher/liveness/heartbeat.py), with real sockets and real
processes on 127.0.0.1 and timings shrunk to fractions of a second: no false loss
whatever the start order, a node killed or frozen named by every other node, node 0
itself watched, the listener on the address it was given, the end of a run no loss;
stray lines and strangers ignored and counted, never a stop; a taken port exit 3."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from launcher.detection.system import free_port
from launcher.liveness.heartbeat import PeerHeartbeat
from tests.harness.runs import ROOT, clean_env, limit

BEAT, LOST_AFTER, SILENCE = 0.1, 0.8, 1.5

NODE = f"""
import sys, time
from launcher.liveness.heartbeat import PeerHeartbeat
master, port, rank, nnodes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
hb = PeerHeartbeat(master, port, rank, nnodes, f"host{{rank}}", {LOST_AFTER},
                   on_lost=lambda line: print("LOST", line, flush=True), silence_s={SILENCE},
                   join_timeout_s=60, log=lambda line: print("LOG", line, flush=True),
                   beat_s={BEAT})
hb.start()
print("READY", flush=True)
time.sleep(float(sys.argv[5]))
hb.close()
hb.join(5)
print("DONE", hb.lost, flush=True)
"""


class Node:
    """One node's launcher side of the heartbeat, as a process of its own."""

    def __init__(self, port: int, rank: int, nnodes: int, lasts_s: float = 30,
                 master: str = "127.0.0.1"):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", NODE, master, str(port), str(rank), str(nnodes),
             str(lasts_s)], cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout.readline().strip() == "READY"

    def output(self) -> str:
        out, _ = self.proc.communicate(timeout=limit(60))
        return out

    def signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)


def in_process(port: int, rank: int, nnodes: int, master: str = "127.0.0.1",
               beat_s: float = BEAT) -> PeerHeartbeat:
    found: list[str] = []
    hb = PeerHeartbeat(master, port, rank, nnodes, f"host{rank}", LOST_AFTER,
                       on_lost=found.append, silence_s=SILENCE, join_timeout_s=60,
                       beat_s=beat_s)
    hb.found, hb.logged = found, []
    hb.log = hb.logged.append
    hb.start()
    return hb


def wait_until(condition, seconds: float = 20) -> bool:
    deadline = time.monotonic() + limit(seconds)
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_nodes_may_start_in_any_order_and_no_one_is_lost():
    """The others wait for node 0 longer than any loss bound; silence counts from when a
    node first beats; a run that ends is no loss."""
    port = free_port()
    early = [Node(port, rank, 3, lasts_s=4 * SILENCE + 2) for rank in (1, 2)]
    time.sleep(2 * SILENCE)  # node 0 starts late: longer than the silence and loss bounds
    zero = in_process(port, 0, 3)
    assert wait_until(lambda: len(zero.watch.peers) == 2), zero.logged
    outputs = [n.output() for n in early]  # they end on their own: goodbye, not lost
    time.sleep(2 * SILENCE)
    zero.close()
    zero.join(5)
    assert zero.found == [] and zero.lost is None, zero.found
    assert all("LOST" not in out and "DONE None" in out for out in outputs), outputs
    assert sorted(zero.logged) == ["heartbeat: node 1 (host1) beats",
                                   "heartbeat: node 2 (host2) beats"]


def test_a_killed_node_is_named_by_node_0_and_by_every_other_node():
    port = free_port()
    zero = in_process(port, 0, 3)
    victim, other = Node(port, 1, 3), Node(port, 2, 3, lasts_s=20)
    assert wait_until(lambda: len(zero.watch.peers) == 2)
    victim.signal(signal.SIGKILL)  # no goodbye: its connection just ends
    killed = time.monotonic()
    assert wait_until(lambda: zero.found), "node 0 never named the killed node"
    assert time.monotonic() - killed < limit(10)
    assert zero.found[0].startswith("lost node 1 (host1): no heartbeat for ")
    assert "its connection ended" in zero.found[0]
    time.sleep(1)  # node 0's word reaches node 2 with its next beat
    other.signal(signal.SIGTERM)
    out = other.output()
    assert f"LOST {zero.found[0]}" in out, out
    zero.close()


def test_a_node_whose_workers_failed_first_reads_node_0s_word_on_the_lost_node():
    """Node 0 stops its workers when it names a lost node; the ranks of another node then
    fail on their lost connection to them, before that node's next beat has read node
    0's word (a beat every 0.5 s here). Its launcher asks for the word, so that every
    survivor names the lost node, not the connection; with nothing said, it has none."""
    port = free_port()
    zero = in_process(port, 0, 3)
    one = in_process(port, 1, 3, beat_s=0.5)
    victim = Node(port, 2, 3)
    assert wait_until(lambda: len(zero.watch.peers) == 2)
    assert one.word_of_node_0(limit(5)) is None  # a beat read, nothing lost
    victim.signal(signal.SIGKILL)
    assert wait_until(lambda: zero.found), "node 0 never named the killed node"
    word = one.word_of_node_0(limit(5))
    assert word == zero.found[0] == one.found[0], (word, zero.found, one.found)
    for hb in (zero, one):
        hb.close()
        hb.join(5)


def test_a_frozen_node_whose_host_answers_is_lost_after_the_silence_only():
    port = free_port()
    zero = in_process(port, 0, 2)
    frozen = Node(port, 1, 2)
    assert wait_until(lambda: len(zero.watch.peers) == 1)
    frozen.signal(signal.SIGSTOP)  # its kernel still acknowledges: not a vanished host
    stopped = time.monotonic()
    try:
        assert wait_until(lambda: zero.found), "the frozen node was never named"
        took = time.monotonic() - stopped
    finally:
        frozen.signal(signal.SIGKILL)
    assert zero.found[0].startswith("lost node 1 (host1): no heartbeat for ")
    assert "though its host answers (frozen or stopped)" in zero.found[0]
    # silence counts from its last beat, up to one beat before the stop
    assert took >= SILENCE - BEAT, \
        f"named after {took:.2f} s, before the silence of {SILENCE} s"
    zero.close()


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_node_0_itself_is_watched(how):
    port = free_port()
    zero = Node(port, 0, 2)
    one = in_process(port, 1, 2)
    assert wait_until(lambda: one.heard_node_0)
    zero.signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    try:
        assert wait_until(lambda: one.found), f"node 0 {how}, never named"
    finally:
        zero.signal(signal.SIGKILL)
    assert one.found[0].startswith("lost node 0 (127.0.0.1): ")
    wanted = "its connection ended" if how == "killed" else "though its host answers"
    assert wanted in one.found[0], one.found


def test_the_listener_binds_the_address_it_was_given_not_every_interface():
    port = free_port()
    zero = in_process(port, 0, 2, master="127.0.0.2")  # a loopback address of this host
    assert wait_until(lambda: _accepts("127.0.0.2", port))
    assert not _accepts("127.0.0.1", port)  # another address of the same host: refused
    assert zero.logged == []
    zero.close()


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def test_nothing_it_receives_is_more_than_a_line_of_json():
    """A stranger's bytes (a pickle, garbage) are skipped; the watch goes on."""
    port = free_port()
    zero = in_process(port, 0, 2)
    assert wait_until(lambda: _accepts("127.0.0.1", port))
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"\x80\x04\x95garbage\n" + json.dumps([1, 2]).encode() + b"\n")
    one = Node(port, 1, 2, lasts_s=2)
    out = one.output()
    zero.close()
    zero.join(5)
    assert "LOST" not in out and zero.found == [], (out, zero.found)


def test_stray_lines_are_ignored_and_counted_and_never_stop_the_watch():
    """A connection to node 0 sends what no node of the job sends (a beat count that is no
    number, a rank the job does not have, another job's beat, a beat without the job's
    token, no JSON, then a line without end). Node 0 keeps watching, takes none of them
    for a node (the old watch died on the first, and would have lost "node 7" once its
    connection ended), says once that it ignores them, and closes the endless line's
    connection. (No real node beside it: on a loaded machine its silence could be named,
    which is not what this test is about.)"""
    port = free_port()
    zero = in_process(port, 0, 2)
    job = zero.token
    assert wait_until(lambda: _accepts("127.0.0.1", port))
    stray = socket.create_connection(("127.0.0.1", port), timeout=limit(10))
    for line in ({"rank": 1, "beat": "abc", "where": "x", "job": job},
                 {"rank": 7, "beat": 1, "where": "x", "job": job},
                 {"rank": 1, "beat": 1, "where": "x", "job": "another job"},
                 {"rank": 1, "beat": 1, "where": "x"}):
        stray.sendall((json.dumps(line) + "\n").encode())
    stray.sendall(b"not json\n" + b"x" * (1 << 20))  # and no newline: an endless line
    assert wait_until(lambda: zero.ignored >= 6), zero.ignored
    assert wait_until(lambda: _closed(stray)), "the endless line's connection stayed open"
    time.sleep(2 * SILENCE)  # longer than a loss of any node it had taken in would take
    assert zero.is_alive() and zero.found == [] and zero.watch.peers == {}
    said = [line for line in zero.logged if "ignoring" in line]
    assert len(said) == 1 and "not this job's beats (from 127.0.0.1:" in said[0], zero.logged
    zero.close()
    zero.join(5)


def _closed(sock: socket.socket) -> bool:
    try:
        sock.settimeout(0.05)
        return sock.recv(1 << 16) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_a_node_that_beats_to_another_program_never_takes_its_lines_for_node_0s():
    """What another program on node 0's port says is not node 0's word: node 1 never
    counts it as heard, so it cannot take that program's lines for a lost node."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    one = in_process(port, 1, 2)
    conn, _ = server.accept()
    conn.sendall(b'{"lost": "lost node 1 (host1): made up", "bye": false}\n' * 3)
    time.sleep(5 * BEAT)
    # (it may name node 0 as silent, later: that program is not node 0)
    assert not one.heard_node_0 and not any("made up" in line for line in one.found)
    one.close()
    conn.close()
    server.close()


def test_a_taken_heartbeat_port_is_refused_before_any_worker_starts():
    from launcher.liveness.heartbeat_wire import listen
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    with pytest.raises(OSError) as caught:
        listen("127.0.0.1", port)
    assert f"the heartbeat port {port} (MASTER_PORT + 1) cannot be listened on" in \
        caught.value.strerror
    holder.close()
    listener, note = listen("127.0.0.1", port)  # free again
    assert note is None and listener.getsockname() == ("127.0.0.1", port)
    listener.close()


def test_the_rank_0_launcher_ends_with_exit_3_naming_a_taken_heartbeat_port():
    """Before it starts torchrun: the other nodes would beat to the program that holds it."""
    from launcher.liveness import watchers
    from launcher.planning.plan import Plan
    from launcher.running.supervise import _bind
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    plan = Plan("torchrun", ("torchrun",), {}, "cpu", "gloo", 1, (2, 2), (2,), 0, "pet",
                heartbeat=("127.0.0.1", port, 0), static_nodes=True)
    assert plan.liveness == ("heartbeat",)
    refused = _bind(watchers.for_plan(plan, print))
    assert refused.code == 3
    assert refused.message.startswith(f"error: the heartbeat port {port} (MASTER_PORT + 1) "
                                      "cannot be listened on") and "another program" in \
        refused.message
    holder.close()
    liveness = watchers.for_plan(plan, print)
    assert _bind(liveness) is None
    listener = liveness.watchers[0].listener
    assert listener.getsockname()[1] == port
    liveness.stop()  # never started: the port is let go
    assert listener.fileno() == -1
    other = dataclasses.replace(plan, heartbeat=("127.0.0.1", port, 1))
    liveness = watchers.for_plan(other, print)
    assert _bind(liveness) is None and liveness.watchers[0].listener is None  # only node 0 listens
