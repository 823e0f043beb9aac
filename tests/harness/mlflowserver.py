"""A local ``mlflow server`` for the tracker tests: SQLite store, artifacts served over
HTTP, on a free 127.0.0.1 port; stopped by its process group. Needs mlflow (``make
trackers``)."""

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

from tests.harness.kubesim import free_port
from tests.harness.runs import clean_env, limit


@contextlib.contextmanager
def mlflow_server(home: Path) -> Iterator[str]:
    """The server's URI, while it runs; its store (``mlflow.db``), artifacts
    (``artifacts/``) and log (``server.log``) are in ``home``."""
    port = free_port()
    log = (home / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
         "--artifacts-destination", str(home / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=home,
        env=clean_env())
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + limit(300)  # the first start migrates the store: ~30 s here
        while True:
            assert server.poll() is None, (home / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=limit(5)) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (home / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=limit(30))
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
