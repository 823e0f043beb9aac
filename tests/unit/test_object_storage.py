"""Checkpoints in object storage (``checkpoint.remote``), in process, against a real S3
server (SeaweedFS, started here on 127.0.0.1): the bucket as a second Storage, the remote
tier's upload, seal, ``latest`` and keep_last, a fetch that verifies every byte, a store
that stops answering or is killed and started again, and the launcher's checks. Whole
runs: tests/e2e/test_object_storage_runs.py. Skips without boto3 and weed (``make s3``)."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

import pytest
import yaml

from launcher.detection.system import free_port
from tests.harness import s3server
from tests.harness.runs import entry, last_line, limit
from train.checkpoint import Checkpointer
from train.core.config import load_config
from train.core.errors import CannotRunHere, ConfigError, RunDirBusy
from train.core.run import rundir, runlock
from train.core.storage import lease as remote_lease
from train.core.storage import s3, urls
from train.core.storage.local import LocalStorage

needs_s3 = pytest.mark.skipif(s3server.missing() is not None, reason=str(s3server.missing()))


def sealed_run(run_dir: Path, steps: list[int], keep_last: int = 5) -> Checkpointer:
    """A run directory with a real sealed checkpoint for each of ``steps``."""
    store = Checkpointer(run_dir, rank=0, keep_last=keep_last)
    for step in steps:
        store.save(step, {"step": step, "weights": list(range(step * 100))}, {"rng": step})
    return store


def tier(tmp_path: Path, prefix: str, keep_last: int = 5):
    from train.checkpoint.tier import RemoteTier
    return RemoteTier.from_url(f"s3://{s3server.BUCKET}/{prefix}", "run",
                               LocalStorage(tmp_path / "run"), keep_last)


def remote_keys(server, prefix: str) -> list[str]:
    listed = server.client().list_objects_v2(Bucket=s3server.BUCKET, Prefix=f"{prefix}/")
    return sorted(o["Key"] for o in listed.get("Contents", []))


# ------------------------------------------------------------------ the config
def config_with(tmp_path: Path, remote: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"output": {"dir": str(tmp_path)},
                                    "checkpoint": {"remote": remote}}))
    return path


@pytest.mark.parametrize("url", ["gs://bucket/x", "s3://", "s3://UPPER/x", "s3://b/x/../y",
                                 "s3://bucket/a//b", "bucket/prefix"])
def test_a_malformed_remote_is_one_line_naming_the_key(tmp_path, url):
    with pytest.raises(ConfigError) as raised:
        load_config(config_with(tmp_path, url))
    line = raised.value.one_line()
    assert "checkpoint.remote" in line and "s3://BUCKET/PREFIX" in line and "\n" not in line
    assert raised.value.exit_code == 2


def test_a_key_in_the_remote_url_is_refused_and_not_echoed(tmp_path):
    with pytest.raises(ConfigError) as raised:
        load_config(config_with(tmp_path, "s3://AKIAEXAMPLE:s3cr3tvalue@bucket/ckpt"))
    line = raised.value.one_line()
    assert "checkpoint.remote" in line and "s3cr3tvalue" not in line
    assert "AKIAEXAMPLE" not in line


def test_a_valid_remote_loads(tmp_path):
    cfg = load_config(config_with(tmp_path, "s3://my-bucket/team/ckpt/"))
    url, problem = urls.parse(cfg.checkpoint.remote)
    assert problem is None and url.run_prefix("r1") == "team/ckpt/r1"
    assert load_config(config_with(tmp_path, "")).checkpoint.remote == ""


def test_without_boto3_a_remote_is_exit_3_saying_how_to_install(monkeypatch):
    real = s3.importlib.util.find_spec
    monkeypatch.setattr(s3.importlib.util, "find_spec",
                        lambda name, *a: None if name == "boto3" else real(name, *a))
    with pytest.raises(CannotRunHere) as raised:
        s3.check("s3://bucket/x", "run", "c.yaml")
    assert "pip install 'trainpod[s3]'" in raised.value.one_line()
    assert raised.value.exit_code == 3


# ------------------------------------------------------------------ preflight
@needs_s3
def test_an_unreachable_store_is_exit_3_naming_endpoint_and_bucket(aws, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)
    with pytest.raises(CannotRunHere) as raised:
        s3.check("s3://ckpt/x", "run", "c.yaml")
    line = raised.value.one_line()
    assert dead in line and "bucket ckpt" in line and "\n" not in line


@needs_s3
def test_a_missing_bucket_is_exit_3_and_a_writable_one_passes(aws):
    with pytest.raises(CannotRunHere) as raised:
        s3.check("s3://no-such-bucket/x", "run", "c.yaml")
    assert "no-such-bucket" in raised.value.one_line()
    s3.check("s3://ckpt/probe", "run", "c.yaml")
    assert remote_keys(aws, "probe") == []  # the probe object is gone again


# ------------------------------------------------------------------ the tier
@needs_s3
def test_a_sealed_checkpoint_is_uploaded_verified_and_named_latest(aws, tmp_path):
    sealed_run(tmp_path / "run", [2])
    remote = tier(tmp_path, "up")
    remote.uploader.sealed(2)
    assert remote.uploader.wait(60) is None
    local = LocalStorage(tmp_path / "run")
    sums = json.loads(local.read_text("checkpoints/step-2/checksums.json"))
    for name, digest in sums.items():
        assert remote.remote.digest(f"checkpoints/step-2/{name}") == digest
    assert remote.listing.latest()[0] == 2 and remote.uploader.uploaded == 2
    assert "up/run/checkpoints/step-2/checksums.json" in remote_keys(aws, "up")


@needs_s3
def test_latest_never_moves_backwards_and_keep_last_applies_remotely(aws, tmp_path):
    sealed_run(tmp_path / "run", [2, 4, 6])
    remote = tier(tmp_path, "order", keep_last=2)
    for step in (2, 4, 6):
        remote.uploader.mirror(step)
    assert remote.listing.steps(sealed=True) == [6, 4]  # step-2 pruned
    assert remote_keys(aws, "order/run/checkpoints/step-2") == []
    remote.uploader.mirror(4)  # a stale writer's older step
    assert remote.listing.latest()[0] == 6


@needs_s3
def test_an_empty_run_directory_fetches_the_newest_remote_checkpoint(aws, tmp_path):
    sealed_run(tmp_path / "run", [2, 4])
    remote = tier(tmp_path, "fetch")
    for step in (2, 4):
        remote.uploader.mirror(step)
    original = (tmp_path / "run/checkpoints/step-4/state.pt").read_bytes()
    LocalStorage(tmp_path).delete("run")
    assert remote.fetcher.fetch_newer() == 4
    assert (tmp_path / "run/checkpoints/step-4/state.pt").read_bytes() == original
    assert Checkpointer(tmp_path / "run", rank=0, keep_last=3).latest_step() == 4
    assert Checkpointer.verify(tmp_path / "run/checkpoints/step-4") is None
    assert remote.fetcher.fetch_newer() is None  # nothing newer than the local one now


@needs_s3
def test_the_runs_record_is_mirrored_and_an_empty_disk_continues_its_metrics(aws, tmp_path):
    """With each seal: metrics.jsonl (its whole lines only: a row being written is left
    for the next seal), the other record files, and the TensorBoard event files that grew.
    A run directory fetched from the store gets the metrics to continue."""
    run = tmp_path / "run"
    sealed_run(run, [2])
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"st')  # mid-write
    (run / "config.yaml").write_text("seed: 0\n")
    events = run / "tb" / "train" / "events.out.tfevents.1.host"
    events.parent.mkdir(parents=True)
    events.write_bytes(b"x" * 10)
    remote = tier(tmp_path, "record")
    remote.uploader.mirror(2)
    s3 = aws.client()

    def stored(name: str) -> bytes:
        return s3.get_object(Bucket=s3server.BUCKET, Key=f"record/run/{name}")["Body"].read()

    assert stored("metrics.jsonl") == b'{"step": 1}\n{"step": 2}\n'
    assert stored("config.yaml") == b"seed: 0\n"
    assert stored("tb/train/events.out.tfevents.1.host") == b"x" * 10
    events.write_bytes(b"y" * 20)  # grew: sent again
    remote.uploader.mirror_record()
    assert stored("tb/train/events.out.tfevents.1.host") == b"y" * 20
    LocalStorage(tmp_path).delete("run")
    assert remote.fetcher.fetch_newer() == 2
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert not (run / "tb").exists()  # a resumed run writes its own event files


@needs_s3
def test_a_flipped_byte_in_the_store_falls_back_naming_the_file(aws, tmp_path, caplog):
    sealed_run(tmp_path / "run", [2, 4])
    remote = tier(tmp_path, "flip")
    for step in (2, 4):
        remote.uploader.mirror(step)
    s3, key = aws.client(), "flip/run/checkpoints/step-4/rank-0.pt"
    data = bytearray(s3.get_object(Bucket=s3server.BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    s3.put_object(Bucket=s3server.BUCKET, Key=key, Body=bytes(data))
    LocalStorage(tmp_path).delete("run")
    with caplog.at_level(logging.WARNING, logger="train"):
        assert remote.fetcher.fetch_newer() == 2
    assert "step-4 is unusable (rank-0.pt does not match its checksum)" in caplog.text
    assert not (tmp_path / "run/checkpoints/step-4").exists()
    assert not (tmp_path / "run/checkpoints/step-4.partial").exists()


@needs_s3
def test_a_store_that_stops_answering_is_one_warning_and_nothing_raised(aws, tmp_path,
                                                                       monkeypatch, caplog):
    sealed_run(tmp_path / "run", [2, 4])
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")
    remote = tier(tmp_path, "gone")
    remote.uploader.sleep = lambda s: None  # the backoff's waits, not what is tested
    with caplog.at_level(logging.WARNING, logger="train"):
        remote.uploader.sealed(2)
        assert remote.uploader.wait(120) is None
        remote.uploader.sealed(4)
        assert remote.uploader.wait(120) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "step-2 and later checkpoints stay local" in warnings[0]
    assert remote.uploader.uploaded is None and remote.uploader.unreachable
    assert rundir.latest_name(tmp_path / "run/checkpoints") == "step-4"


@needs_s3
def test_an_upload_held_up_is_named_as_only_local_then_seals_once_the_store_answers(
        aws, tmp_path, caplog):
    """The store stops answering (its process paused) while a checkpoint uploads: a wait
    bounded like a grace period names the step that is only local; once the store
    answers again the same upload goes on and the checkpoint seals remotely."""
    sealed_run(tmp_path / "run", [2])
    remote = tier(tmp_path, "held")
    os.killpg(aws.proc.pid, signal.SIGSTOP)
    try:
        remote.uploader.sealed(2)
        with caplog.at_level(logging.WARNING, logger="train"):
            assert remote.uploader.wait(1) == 2
        assert "checkpoint step-2 is only local: its upload to s3://ckpt/held/run did not " \
               "finish within 1 s" in caplog.text
    finally:
        os.killpg(aws.proc.pid, signal.SIGCONT)
    assert remote.uploader.wait(120) is None
    assert remote.listing.latest()[0] == 2 and remote.uploader.uploaded == 2




@needs_s3
def test_a_store_killed_and_started_again_seals_the_checkpoints_it_missed(tmp_path,
                                                                          monkeypatch, caplog):
    """The server's process killed while step-2 uploads and started again (same data,
    same port) within the tier's backoff: the same upload goes on, step-2 seals, no
    warning. Killed for longer: one warning, step-4 stays local; the next checkpoint
    after the restart (step-6) seals, saying so."""
    with s3server.s3_server(tmp_path / "s3") as server:
        server.reach_in_process(monkeypatch)
        store = sealed_run(tmp_path / "run", [2])
        remote = tier(tmp_path, "killed")
        restarted: list[float] = []

        def restart_during_backoff(seconds: float) -> None:
            if not restarted:
                restarted.append(seconds)
                s3server.start(server)

        remote.uploader.sleep = restart_during_backoff
        s3server.stop(server)
        with caplog.at_level(logging.WARNING, logger="train"):
            remote.uploader.sealed(2)
            assert remote.uploader.wait(limit(120)) is None
            assert restarted and remote.uploader.uploaded == 2 and remote.listing.latest()[0] == 2
            assert not caplog.records, caplog.text
            remote.uploader.sleep = lambda seconds: None  # the store stays away through the backoff
            s3server.stop(server)
            store.save(4, {"step": 4, "weights": [4]}, {"rng": 4})
            remote.uploader.sealed(4)
            assert remote.uploader.wait(limit(120)) is None
            s3server.start(server)
            store.save(6, {"step": 6, "weights": [6]}, {"rng": 6})
            remote.uploader.sealed(6)
            assert remote.uploader.wait(limit(120)) is None
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 2, warnings
        assert "step-4 and later checkpoints stay local until the store answers" in warnings[0]
        assert "work again: step-6 is there" in warnings[1]
        assert remote.listing.latest()[0] == 6 and remote.uploader.uploaded == 6


# ------------------------------------------------------------- the remote lease
QUICK = runlock.LeaseTimes(renew_s=0.2, expiry_s=30, wait_s=1)


def lease_record(server, key: str) -> dict:
    return json.loads(server.client().get_object(Bucket=s3server.BUCKET, Key=key)["Body"].read())


@needs_s3
def test_one_job_at_a_time_holds_a_remote_run(aws):
    """Members of one job share it; another job waits, then exit 6 naming the holder and
    the store; once released, the other job takes it at once."""
    said = []
    url = f"s3://{s3server.BUCKET}/lease"
    held = remote_lease.acquire(url, "run", "job-a", QUICK, said.append)
    member = remote_lease.acquire(url, "run", "job-a", QUICK, said.append)
    with pytest.raises(RunDirBusy) as busy:
        remote_lease.acquire(url, "run", "job-b", QUICK, said.append)
    assert "the remote run s3://ckpt/lease/run/lease.json is in use by job job-a" in \
        str(busy.value) and "still after 1 s (run.lock_wait_s)" in str(busy.value)
    assert busy.value.exit_code == 6
    member.release()
    held.release()
    other = remote_lease.acquire(url, "run", "job-b", QUICK, said.append)
    assert lease_record(aws, "lease/run/lease.json")["job"] == "job-b"
    other.release()
    assert lease_record(aws, "lease/run/lease.json")["released"]


@needs_s3
def test_a_release_waits_no_longer_than_its_bound_for_a_store_that_stopped_answering(aws):
    """The launcher releases the lease as it ends, often after a stop signal, within the
    platform's grace period: a store that stopped answering there (paused) holds the
    release up only as long as asked (each of its calls would wait a minute); the lease
    then expires by itself."""
    lease = remote_lease.acquire(f"s3://{s3server.BUCKET}/paused", "run", "job-d", QUICK,
                                 lambda line: None)
    releasing = threading.Thread(target=lease.release, kwargs={"wait_s": 0.5})
    os.killpg(aws.proc.pid, signal.SIGSTOP)
    try:
        releasing.start()
        releasing.join(limit(30))
        assert not releasing.is_alive(), "the release still waits for the store"
    finally:
        os.killpg(aws.proc.pid, signal.SIGCONT)


@needs_s3
def test_a_remote_lease_not_renewed_is_taken_over_saying_whose(aws):
    stale = {"job": "gone", "host": "elsewhere", "pid": 1, "renewed": 0, "renewals": 3}
    aws.client().put_object(Bucket=s3server.BUCKET, Key="stale/run/lease.json",
                            Body=json.dumps(stale).encode())
    said = []
    lease = remote_lease.acquire(f"s3://{s3server.BUCKET}/stale", "run", "job-c", QUICK,
                                 said.append)
    assert lease_record(aws, "stale/run/lease.json")["job"] == "job-c"
    assert len(said) == 1 and said[0].startswith(
        "taking over the remote run s3://ckpt/stale/run/lease.json from job gone (pid 1 on "
        "elsewhere; renewed ")
    lease.release()


@needs_s3
def test_the_launcher_refuses_a_remote_run_another_job_holds(aws, tmp_path):
    """Two jobs on different disks, one remote run: the second launch waits
    run.lock_wait_s, then exits 6 in one line, before any worker starts."""
    held = remote_lease.acquire(f"s3://{s3server.BUCKET}/two", "r", "first-job",
                                runlock.LeaseTimes(renew_s=0.5, expiry_s=60, wait_s=1),
                                lambda line: None)
    try:
        tree = {"output": {"dir": str(tmp_path / "runs")}, "run": {"name": "r"},
                "checkpoint": {"remote": f"s3://{s3server.BUCKET}/two"}}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(tree))
        proc = entry("train", str(tmp_path / "c.yaml"), "run.lock_wait_s=2", cwd=tmp_path,
                     env=aws.env(), timeout=120)
    finally:
        held.release()
    assert proc.returncode == 6, proc.stderr[-2000:]
    line = last_line(proc.stderr)
    assert "the remote run s3://ckpt/two/r/lease.json is in use by job first-job" in line
    assert "Traceback" not in proc.stderr and "train.worker" not in proc.stderr


def test_the_trainer_imports_without_boto3():
    """boto3 is an optional extra: the base install (and the images) train without it,
    so nothing the worker imports may need it unless a remote is configured."""
    import subprocess
    import sys
    code = ("import sys\n"
            "for name in ('boto3', 'botocore', 's3transfer'):\n"
            "    sys.modules[name] = None  # as if not installed: importing them fails\n"
            "import train.loop.trainer, train.loop.components, train.checkpoint.tier\n"
            "print('imported')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=limit(120))
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-2000:]
