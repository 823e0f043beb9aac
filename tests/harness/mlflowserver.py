"""A local ``mlflow server`` for the tracker tests: SQLite store, artifacts served over
HTTP, on a free 127.0.0.1 port; stopped by its process group. Needs mlflow (``make
trackers``). :class:`MlflowServer` can also be killed mid-run (SIGKILL, as a crash or
the out-of-memory killer would) and started again at the same address and store."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from launcher.detection.system import free_port
from tests.harness.runs import clean_env, limit


class MlflowServer:
    """One server's home (``mlflow.db``, ``artifacts/``, ``server.log``) and address;
    each :meth:`start` is a new server process on them."""

    def __init__(self, home: Path):
        self.home, self.port = home, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        """Starts it and waits until it answers; its URI."""
        with (self.home / "server.log").open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
                 str(self.port), "--workers", "1", "--backend-store-uri",
                 f"sqlite:///{self.home / 'mlflow.db'}",
                 "--artifacts-destination", str(self.home / "artifacts")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.home,
                env=clean_env())
        deadline = time.monotonic() + limit(300)  # the first start migrates the store: ~30 s
        while not self.answers():
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.5)
        return self.uri

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=limit(5)) as answer:
                return answer.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """Every process of the server at once, with no chance to answer or close."""
        if self.proc is not None:  # its workers too, even when the first is gone
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=limit(30))
        except subprocess.TimeoutExpired:
            self.kill()

    def log(self) -> str:
        return (self.home / "server.log").read_text()[-3000:]


@contextlib.contextmanager
def mlflow_server(home: Path) -> Iterator[str]:
    """The server's URI, while it runs; its store (``mlflow.db``), artifacts
    (``artifacts/``) and log (``server.log``) are in ``home``."""
    server = MlflowServer(home)
    try:
        yield server.start()
    finally:
        server.stop()
