"""Whole runs with ``checkpoint.remote`` against a real S3 server (SeaweedFS on 127.0.0.1,
tests/harness/s3server.py): a pod's replacement with an empty run directory resumes from
the store bitwise as the uninterrupted run went on (FSDP shards of two processes),
passing over a remote checkpoint with a flipped byte (named); a store that goes away
mid-run is one warning and exit 0; a store that hangs at the end of a run ends it within
train.shutdown_timeout_s with exit 7, never restarted, and the next start uploads the
final checkpoint; a store the launcher cannot reach is exit 3 before any worker starts;
the credentials appear in nothing a run writes or prints; and the Kubernetes manifests
with k8s/kustomize/objectstore (no shared volume) resume a two-pod job whose pod was
replaced on a new node from the store. The tier in process:
tests/unit/test_object_storage.py. Skips without boto3 and weed (``make s3``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.detection.system import free_port
from tests.harness import s3server
from tests.harness.runs import (
    _STDERR_LINES,
    ROOT,
    TINY_GPT,
    entry,
    limit,
    losses,
    merge,
    patched_on_import,
    read_until,
    write_config,
)

pytestmark = pytest.mark.skipif(s3server.missing() is not None,
                                reason=str(s3server.missing()))
STEPS = 4


def remote_config(tmp_path: Path, prefix: str, **checkpoint) -> Path:
    tree = merge(TINY_GPT, {"output": {"dir": str(tmp_path / "runs")}, "run": {"name": "r"},
                            "model": {"dropout": 0.1}, "train": {"max_steps": STEPS},
                            "checkpoint": {"every_steps": 2, "keep_last": 3,
                                           "remote": f"s3://{s3server.BUCKET}/{prefix}",
                                           **checkpoint}})
    return write_config(tmp_path / "c.yaml", tree)


def train(config: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    return entry("train", str(config), *overrides, cwd=ROOT, env=env, timeout=240)


def shards(step_dir: Path) -> dict[str, bytes]:
    """Each rank's model and optimizer shards, byte for byte."""
    return {p.name: p.read_bytes() for p in (step_dir / "model").glob("*.distcp")}


def flip_a_byte(s3_server, key: str) -> None:
    s3 = s3_server.client()
    data = bytearray(s3.get_object(Bucket=s3server.BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    s3.put_object(Bucket=s3server.BUCKET, Key=key, Body=bytes(data))


def files_holding(top: Path, secrets: list[str]) -> list[str]:
    return [str(p) for p in top.rglob("*") if p.is_file() and not p.is_symlink()
            and any(s.encode() in p.read_bytes() for s in secrets)]


def test_an_empty_disk_resumes_fsdp_shards_from_the_store_bitwise(s3_server, tmp_path):
    """FSDP on two processes (the launcher's torchrun, gloo) uploads step-2 and step-4,
    each rank's shards included. The pod is then replaced by one with an empty disk, and
    one shard of step-4 has a flipped byte in the store: the new pod names the file,
    downloads step-2 and trains on to exactly the losses and shards of the uninterrupted
    run. The test's access key and secret appear in no file the runs wrote and nothing
    they printed."""
    config = remote_config(tmp_path, "fsdp")
    sharded = ("distributed.strategy=fsdp", "distributed.nproc_per_node=2", "model.depth=2")
    first = train(config, s3_server.env(), *sharded)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "runs" / "r"
    reference, final = losses(run), shards(run / "checkpoints" / f"step-{STEPS}")
    listed = s3_server.client().list_objects_v2(Bucket=s3server.BUCKET, Prefix="fsdp/r/")
    keys = {o["Key"] for o in listed["Contents"]}
    assert {f"fsdp/r/checkpoints/step-4/model/__{r}_0.distcp" for r in (0, 1)} <= keys
    secrets = [s3server.SECRET_KEY, s3server.ACCESS_KEY]
    outputs = first.stdout + first.stderr
    assert files_holding(run, secrets) == []
    shutil.rmtree(tmp_path / "runs")

    flip_a_byte(s3_server, "fsdp/r/checkpoints/step-4/model/__1_0.distcp")
    again = train(config, s3_server.env(), *sharded)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step-4 is unusable (model/__1_0.distcp does not match its checksum)" in again.stderr
    assert "fetched checkpoint step-2 from s3://ckpt/fsdp/r" in again.stderr
    assert "at step 2, sample 16 (saved with world size 2, now 2)" in again.stderr
    got = losses(run)
    assert [got[s] for s in range(3, STEPS + 1)] == [reference[s] for s in range(3, STEPS + 1)]
    assert shards(run / "checkpoints" / f"step-{STEPS}") == final
    outputs += again.stdout + again.stderr
    assert files_holding(run, secrets) == []
    assert not [s for s in secrets if s in outputs]


def test_a_store_that_goes_away_mid_run_is_one_warning_and_exit_0(s3_server, tmp_path):
    """The store answers the worker's check, then is gone before the first upload: every
    checkpoint stays local, one warning says so, the run finishes (exit 0)."""
    home = tmp_path / "s3"
    home.mkdir()
    config = remote_config(tmp_path, "gone")
    with s3server.s3_server(home) as doomed:
        proc = subprocess.Popen([sys.executable, "-m", "train", str(config)], cwd=ROOT,
                                env={**doomed.env(), "PYTHONPATH": str(ROOT),
                                     "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            read_until(proc, r"INFO model gpt:", timeout=120)  # checked, not yet trained
            os.kill(proc.pid, signal.SIGSTOP)  # no step runs while the store goes away
            s3server.stop(doomed)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        proc.wait(timeout=limit(240))
    stderr = rest_of_stderr(proc)
    assert proc.returncode == 0, stderr[-3000:]
    warnings = [line for line in stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, warnings
    assert "stay local until the store answers again; training goes on" in warnings[0]
    checkpoints = tmp_path / "runs" / "r" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-2", "step-4"]


def rest_of_stderr(proc: subprocess.Popen) -> str:
    """The stderr lines of a finished process that read_until's reader has not consumed."""
    lines, out = _STDERR_LINES[proc.pid], []
    while (line := lines.get(timeout=limit(30))) is not None:
        out.append(line)
    return "".join(out)


def test_the_launcher_refuses_a_store_it_cannot_reach_before_any_worker(s3_server, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    config = remote_config(tmp_path, "dead")
    proc = train(config, s3_server.env(AWS_ENDPOINT_URL_S3=dead))
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert dead in line and "bucket ckpt" in line and "checkpoint.remote" in line
    assert "Traceback" not in proc.stderr and "train.worker" not in proc.stderr
    assert not (tmp_path / "runs" / "r" / "checkpoints").exists()


# A sitecustomize for the pods given it: every rank waits after its step HOLD_AT (once it
# is logged) until HOLD_DIR/go exists, so that a pod is lost at a known step whatever the
# machine's speed.
HOLD = patched_on_import("train.checkpoint.policy", """
due = module.Cadence.due
def held(self, step, last):
    folder = Path(os.environ["HOLD_DIR"])
    if step == int(os.environ["HOLD_AT"]) and not (folder / "go").exists():
        (folder / f"held-{os.environ['RANK']}").touch()
        while not (folder / "go").exists():
            time.sleep(0.05)
    return due(self, step, last)
module.Cadence.due = held
""")


def test_a_pod_on_a_new_node_resumes_a_two_pod_job_from_the_store(s3_server, tmp_path):
    """The CPU manifests with k8s/kustomize/objectstore, played by the stand-in kubelet
    (tests/harness/kubesim.py): two worker pods (TRAIN_NNODES=2, FSDP's sharded
    checkpoints), each with its run directory in its own emptyDir, the credentials from
    the Secret train-s3. After step-10 is sealed in the store (both pods' parts) and step
    12 is logged, pod 1's node is lost; its replacement starts with an empty disk, the
    other pod keeps its own. The job resumes from the store at step 10, the exact next
    sample, logs the lost attempt's losses for steps 11 and 12 bitwise, and finishes;
    the new pod fetched only its own rank's shards, and the store's metrics hold every
    step once."""
    from tests.e2e.test_k8s_sim_runs import SHORT
    from tests.harness.kubesim import JOB, Cluster, kustomized
    folder = kustomized(tmp_path, ["../cpu"], ["../objectstore"])
    keys = {k: v for k, v in s3_server.env().items() if k.startswith("AWS_")}
    sim = Cluster(folder, tmp_path, network=False, secrets={"train-s3": keys})
    s3 = s3_server.client()
    hold, site = tmp_path / "hold", tmp_path / "site"
    hold.mkdir()
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOLD)
    end = 16
    args = [*SHORT, "checkpoint.remote=s3://ckpt/k8s", "checkpoint.every_steps=10",
            "distributed.strategy=fsdp", f"train.max_steps={end}"]
    two = {"TRAIN_NNODES": "2"}

    def stored(name: str) -> str:
        got = s3.get_object(Bucket=s3server.BUCKET, Key=f"k8s/train-demo/{name}")
        return got["Body"].read().decode()

    def sealed_remotely() -> int | None:
        try:
            return int(stored("checkpoints/latest").strip().split("-")[1])
        except s3.exceptions.NoSuchKey:
            return None

    try:
        sim.start_deployment("train-rendezvous").wait_for(r"listening on", 60)
        pods = [sim.start_index(JOB, i, args, env={**two, "PYTHONPATH": str(site),
                                                  "HOLD_DIR": str(hold), "HOLD_AT": "12"})
                for i in (0, 1)]
        wait_until(lambda: len(list(hold.glob("held-*"))) == 2 or None, limit(240), pods[0])
        wait_until(sealed_remotely, limit(120), pods[0])
        assert sealed_remotely() == 10
        runs = [tmp_path / "pods" / p.name / "runs" / "train-demo" for p in pods]
        before = next(losses(r) for r in runs if (r / "metrics.jsonl").exists())  # rank 0's
        pods[1].kill()  # the node is gone, and its disk with it
        (hold / "go").touch()
        new = sim.start_index(JOB, 1, args, env=two)
        codes = [pods[0].wait(limit(300)), new.wait(limit(300))]
    finally:
        sim.close()
    said = pods[0].text() + new.text()
    assert codes == [0, 0], said[-5000:]
    assert "the run directory is node-local" in said
    assert "fetched checkpoint step-10 from s3://ckpt/k8s/train-demo" in said
    assert f"at step 10, sample {10 * 24} (saved with world size 2, now 2)" in said
    rows = [json.loads(line) for line in stored("metrics.jsonl").splitlines()]
    after = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, end + 1))
    assert [after[s] for s in (11, 12)] == [before[s] for s in (11, 12)]
    fetched = tmp_path / "pods" / new.name / "runs" / "train-demo" / "checkpoints" / "step-10"
    shards = sorted(p.name for p in (fetched / "model").glob("__*_0.distcp"))
    assert len(shards) == 1, shards  # its own rank's; the other pod's stayed there
    assert not (tmp_path / "pvc").exists()  # no shared volume was there to use


def wait_until(sealed, seconds: float, pod) -> None:
    deadline = time.monotonic() + seconds
    while sealed() is None:
        assert pod.running, pod.text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint reached the store"
        time.sleep(0.5)


# A sitecustomize: the uploader freezes the S3 server (SIGSTOP of its process group: a
# store that accepts connections and never answers) as it starts to upload step FREEZE_AT.
FREEZE = patched_on_import("train.checkpoint.uploader", """
mirror = module.Uploader.mirror
def frozen_at(self, step, *args, **kwargs):
    if step == int(os.environ["FREEZE_AT"]):
        import signal
        os.killpg(int(os.environ["S3_PGID"]), signal.SIGSTOP)
    return mirror(self, step, *args, **kwargs)
module.Uploader.mirror = frozen_at
""")


def test_a_store_hung_at_the_end_is_exit_7_and_the_next_start_uploads_the_final_checkpoint(
        tmp_path):
    """Two processes: the final checkpoint's upload hangs; the end waits
    train.shutdown_timeout_s, says so in one line and exits 7, and torchrun does not
    restart the finished run. With the store answering again, the same command uploads
    step 4, names it latest in the store, and exits 0."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FREEZE)
    config = remote_config(tmp_path, "hung")
    with s3server.s3_server(tmp_path / "s3") as server:
        pgid = os.getpgid(server.proc.pid)
        try:
            first = train(config, server.env(PYTHONPATH=str(site), FREEZE_AT=str(STEPS),
                                             S3_PGID=str(pgid)),
                          "distributed.nproc_per_node=2", "train.shutdown_timeout_s=3")
        finally:
            os.killpg(pgid, signal.SIGCONT)
        s3 = server.client()
        before = s3.get_object(Bucket=s3server.BUCKET, Key="hung/r/checkpoints/latest")
        again = train(config, server.env())
        after = s3.get_object(Bucket=s3server.BUCKET, Key="hung/r/checkpoints/latest")
        stored = {o["Key"] for o in s3.list_objects_v2(Bucket=s3server.BUCKET,
                                                       Prefix="hung/r/checkpoints/step-4/")
                  .get("Contents", [])}
    line = first.stderr.strip().splitlines()[-1]
    assert first.returncode == 7, first.stderr[-3000:]
    assert line.startswith("error: the run finished, but its final checkpoint step-4 is "
                           "only on this disk") and "train.shutdown_timeout_s=3" in line
    assert "restarting" not in first.stderr and "Traceback" not in first.stderr
    assert before["Body"].read() == b"step-2\n"
    assert again.returncode == 0, again.stderr[-3000:]
    assert "checkpoint step-4 is in s3://ckpt/hung/r and named latest there" in again.stderr
    assert after["Body"].read() == b"step-4\n"
    local = json.loads((tmp_path / "runs" / "r" / "checkpoints" / "step-4" /
                        "checksums.json").read_text())
    assert stored == {f"hung/r/checkpoints/step-4/{name}" for name in [*local,
                                                                      "checksums.json"]}

