"""The end of a run, bounded (train/guards/shutdown.py), with real threads and processes:
a tracker's sender through an outage and at a close it cannot finish
(train/observe/sender.py), the shutdown's deadline cut short by a stop signal, and
DataLoader workers that never finish exiting (train/data/loader.py ``end_workers``).
Against a real MLflow server killed mid-run: tests/e2e/test_trackers_runs.py.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch
from torch.utils.data import Dataset

from tests.harness.procs import alive
from tests.harness.runs import ROOT, limit
from train.data.loader import end_workers, make_loader
from train.guards.shutdown import SIGNALLED_S, Shutdown
from train.observe.sender import Sender, cause


class Server:
    """What a tracker's calls reach: rows it took, in order; while ``down``, every call
    fails as a connection to a server that is gone does; ``answered`` is set by each call
    that succeeded."""

    def __init__(self):
        self.rows, self.closed, self.down = [], False, False
        self.answered, self.refused = threading.Event(), threading.Event()

    def send_rows(self, rows):
        if self.down:
            self.refused.set()
            raise ConnectionRefusedError(111, "Connection refused")
        self.rows.extend(rows)
        self.answered.set()

    def close(self):
        if self.down:
            raise ConnectionRefusedError(111, "Connection refused")
        self.closed = True


def outage_only(exc: BaseException) -> bool:
    return not isinstance(exc, ConnectionError)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def seconds(n: float):
    bound = Shutdown(limit(n))
    return bound.seconds_left


def test_an_outage_is_one_warning_when_it_starts_and_one_when_it_ends(caplog):
    server = Server()
    sender = Sender("Tracker", server.send_rows, outage_only)
    sender.metrics(1, {"loss": 1.0, "lr": 0.1})
    assert server.answered.wait(limit(10))
    server.down = True
    sender.metrics(2, {"loss": 2.0, "lr": 0.1})
    assert server.refused.wait(limit(10))
    for step in range(3, 6):  # handed over at once, whatever the server does
        sender.metrics(step, {"loss": float(step), "lr": 0.1})
    server.answered.clear()
    server.down = False  # the server is back: the next try sends what waited
    assert server.answered.wait(limit(30))
    sender.close(server.close)
    assert sender.wait(seconds(30)) is None
    assert [step for step, _ in server.rows] == [1, 2, 3, 4, 5] and server.closed
    said = warnings(caplog)
    assert len(said) == 2, said
    assert said[0].startswith("Tracker unreachable from step 2 (")
    assert "([Errno 111] Connection refused); training goes on" in said[0]
    assert said[1].startswith("Tracker back after ")
    assert said[1].endswith(": 8 metrics buffered (sent now), 0 dropped")


def test_an_outage_longer_than_the_buffer_drops_the_oldest_and_counts_them(caplog):
    server = Server()
    server.down = True
    sender = Sender("Tracker", server.send_rows, outage_only, capacity=6)
    sender.metrics(1, {"loss": 1.0, "lr": 0.1})
    assert server.refused.wait(limit(10))
    for step in range(2, 6):
        sender.metrics(step, {"loss": 1.0, "lr": 0.1})  # 10 values in all; 6 fit
    server.down = False
    sender.close(server.close)
    assert sender.wait(seconds(30)) is None
    assert [step for step, _ in server.rows] == [3, 4, 5], "the newest kept, in order"
    assert any(w.endswith(": 6 metrics buffered (sent now), 4 dropped")
               for w in warnings(caplog)), warnings(caplog)


def test_a_close_the_server_never_answers_is_abandoned_at_the_deadline(caplog):
    server = Server()
    server.down = True
    sender = Sender("Tracker", server.send_rows, outage_only)
    sender.metrics(7, {"loss": 1.0, "lr": 0.1, "grad_norm": 2.0})
    sender.close(server.close)
    left = sender.wait(seconds(1))
    assert left is not None and left.startswith("Tracker (3 metrics unsent, its run left "
                                                "RUNNING on the server")
    assert "unreachable for" in left
    sender.metrics(8, {"loss": 1.0})  # after the close: ignored, nothing waits on it
    assert server.rows == [] and not server.closed
    assert len(warnings(caplog)) == 1  # the outage's; the abandon is the shutdown's line


def test_a_tracker_that_refuses_a_call_is_left_out_with_one_warning(caplog):
    def refuse(rows):
        raise ValueError("RESOURCE_DOES_NOT_EXIST: run deleted")
    sender = Sender("Tracker", refuse, outage_only)
    steady = Server()
    other = Sender("Other", steady.send_rows, outage_only)
    for step in (1, 2, 3):
        sender.metrics(step, {"loss": 1.0})
        other.metrics(step, {"loss": 1.0})
    closed = []
    sender.close(lambda: closed.append("closed"))
    other.close(steady.close)
    assert sender.wait(seconds(30)) is None and other.wait(seconds(30)) is None
    assert not sender.running and closed == [], "a tracker left out is not closed"
    assert [step for step, _ in steady.rows] == [1, 2, 3] and steady.closed
    said = warnings(caplog)
    assert len(said) == 1 and said[0].startswith(
        "Tracker: logging failed (RESOURCE_DOES_NOT_EXIST: run deleted); training goes on "
        "without it")


def test_a_stop_signal_leaves_the_shutdown_a_couple_of_seconds():
    now = [100.0]
    bound = Shutdown(30.0, clock=lambda: now[0])
    assert not bound.begun
    assert bound.seconds_left() == 30.0 and bound.begun
    now[0] += 10
    assert bound.seconds_left() == 20.0
    bound.signalled()
    assert bound.seconds_left() == SIGNALLED_S
    now[0] += SIGNALLED_S + 1
    assert bound.seconds_left() == 0.0
    # a run stopped by a signal (before its end began) gets the short bound from the start
    stopped = Shutdown(30.0, clock=lambda: now[0])
    stopped.signalled()
    assert stopped.seconds_left() == SIGNALLED_S


def test_what_was_abandoned_is_one_line(caplog):
    bound = Shutdown(5.0)
    bound.report()
    assert warnings(caplog) == []
    bound.abandon("MLflow (3 metrics unsent; unreachable for 40 s)")
    bound.abandon("DataLoader worker process 123 (killed)")
    bound.report()
    said = warnings(caplog)
    assert len(said) == 1 and "train.shutdown_timeout_s=5" in said[0]
    assert "MLflow (3 metrics unsent; unreachable for 40 s); DataLoader worker process 123" \
        in said[0]


# ------------------------------------------------------------- DataLoader workers


class Numbers(Dataset):
    def __len__(self):
        return 64

    def __getitems__(self, indices):
        return torch.tensor(indices, dtype=torch.float32), torch.zeros(len(indices))


class PrefetchingFromAStore(Numbers):
    """A dataset that reads ahead from a remote store on a thread of its own (a plain,
    non-daemon thread, as a storage client's pool is): the store accepted the
    connection and never answers, so the thread never ends, and the worker's interpreter
    waits for it on its way out forever."""

    def __init__(self, address):
        self.address = address

    def __getitems__(self, indices):
        if not hasattr(self, "reader"):
            conn = socket.create_connection(self.address)
            self.reader = threading.Thread(target=conn.recv, args=(1,))
            self.reader.start()
        return super().__getitems__(indices)


def batches_of(dataset):
    sampler = [list(range(i, i + 8)) for i in range(0, 64, 8)]
    loader = make_loader(dataset, sampler, num_workers=1, pin_memory=False,
                         persistent_workers=True, prefetch_factor=2, seed=0)
    batches = iter(loader)
    x, _ = next(batches)
    assert x.tolist() == list(range(8))
    return batches


def test_loader_workers_end_when_asked_and_one_stuck_on_its_way_out_is_killed():
    healthy = batches_of(Numbers())
    pids = [w.pid for w in healthy._workers]
    assert end_workers(healthy, seconds(30)) is None
    assert not any(alive(p) for p in pids)

    with socket.create_server(("127.0.0.1", 0)) as silent_store:  # never answers
        stuck = batches_of(PrefetchingFromAStore(silent_store.getsockname()))
        pids = [w.pid for w in stuck._workers]
        killed = end_workers(stuck, seconds(30))
        assert killed == f"DataLoader worker process {pids[0]} (killed: still running 5 s " \
                         "after it was told to stop)"
        assert not any(alive(p) for p in pids)
        assert end_workers(stuck, seconds(30)) is None, "once only"


@pytest.fixture(autouse=True)
def _train_logger(caplog):
    caplog.set_level(logging.INFO, logger="train")


def test_an_outage_is_named_by_its_cause_not_the_client_s_whole_message():
    message = ("API request to http://127.0.0.1:5000/api/2.0/mlflow/runs/log-batch failed "
               "with exception HTTPConnectionPool(host='127.0.0.1', port=5000): Max retries "
               "exceeded with url: /api/2.0/mlflow/runs/log-batch (Caused by NewConnection"
               "Error(\"HTTPConnection(host='127.0.0.1', port=5000): Failed to establish a new "
               "connection: [Errno 111] Connection refused\"))")
    assert cause(RuntimeError(message)) == "[Errno 111] Connection refused"
    assert cause(TimeoutError("read timed out")) == "read timed out"


# A run's end in a process of its own: a tracker whose server accepted the connection and
# never answers, a shutdown bound of 10 minutes, the trainer's signal handling.
ENDING = """
import socket, sys
from train.distributed.ranks import configure_logging
from train.guards.shutdown import Shutdown
from train.guards.stopping import StopFlag
from train.observe.sender import Sender

configure_logging(0)
shutdown = Shutdown(600.0)
StopFlag(shutdown).install()
server = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sender = Sender("Tracker", lambda rows: server.recv(1), lambda exc: False)
sender.metrics(1, {"loss": 1.0})
sender.close(lambda: None)
shutdown.begin()
print("ending", flush=True)
shutdown.abandon(sender.wait(shutdown.seconds_left))
shutdown.report()
"""


def test_a_stop_signal_during_the_end_ends_it_within_seconds():
    with socket.create_server(("127.0.0.1", 0)) as silent:
        proc = subprocess.Popen([sys.executable, "-c", ENDING, str(silent.getsockname()[1])],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout.readline() == "ending\n"
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=limit(60))  # far below its 600 s bound
        finally:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "received SIGTERM during the run's end: ending within 2 s" in stderr
    ending = [line for line in stderr.splitlines() if "shutdown:" in line]
    assert len(ending) == 1 and "(2 s after a stop signal)" in ending[0], stderr
    assert "Tracker (1 metrics unsent, its run left RUNNING on the server; a call did not " \
           "return)" in ending[0]
