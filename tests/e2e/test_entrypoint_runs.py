"""entrypoint.py training for real: two ranks through torchrun (gloo on 127.0.0.1),
SIGTERM -> 143 with a checkpoint, doctor --comm over two processes, and two simulated
nodes joining the standalone store. Its quick answers: tests/unit/test_entrypoint.py."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

from tests.harness.runs import ENTRY, QUICKSTART, clean_env, entry, limit, read_until

# Small enough that 20 steps on 2 ranks take seconds on a 2-core machine.
SMALL = ["model.depth=1", "model.width=32", "model.heads=4", "model.context_length=32",
         "train.global_batch_size=8", "data.max_bytes=200000", "data.num_workers=0",
         "schedule.warmup_steps=2", "train.eval_batches=1", "logging.every_steps=5",
         "logging.progress=plain", "checkpoint.every_steps=0"]


def test_doctor_comm_all_reduce_over_two_cpu_processes(tmp_path):
    out = entry("doctor", "--comm", "--json", cwd=tmp_path, timeout=120)
    comm = json.loads(out.stdout)["comm"]
    assert out.returncode == 0, out.stdout
    assert comm["ok"] and comm["processes"] == 2 and comm["backend"] == "gloo"
    assert [r["stage"] for r in comm["ranks"]] == ["done", "done"]


# ------------------------------------------------------------------ real training

def test_train_two_ranks_through_torchrun(tmp_path):
    out = entry("train", QUICKSTART, "distributed.nproc_per_node=2", "train.max_steps=20",
                *SMALL, cwd=tmp_path, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "-m launcher.torchrun --standalone" in out.stderr
    assert "world size 2" in out.stdout + out.stderr
    run = tmp_path / "runs" / "quickstart"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if "loss" in r) == 20
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-20"
    assert json.loads((run / "manifest.json").read_text())
    logs = list((run / "logs").glob("*/attempt_0/1/stderr.log"))
    assert logs  # each rank's log on disk


def test_sigterm_during_training_checkpoints_and_exits_143(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, ENTRY, "train", QUICKSTART, "distributed.nproc_per_node=2",
         "train.max_steps=100000", *SMALL, "logging.every_steps=1"],
        cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        read_until_stdout(proc, r"step 3/")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=limit(60))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out[-3000:]
    assert "stopped by SIGTERM; rerun the same command" in out
    assert "Traceback" not in out and "SignalException" not in out
    latest = tmp_path / "runs" / "quickstart" / "checkpoints" / "latest"
    assert latest.read_text().startswith("step-")


def read_until_stdout(proc: subprocess.Popen, pattern: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + limit(timeout)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise AssertionError("exited early")
        if re.search(pattern, line):
            return
    raise AssertionError(f"no line matching {pattern!r}")


def test_two_nodes_join_the_standalone_store_as_an_indexed_job(tmp_path):
    store = subprocess.Popen([sys.executable, ENTRY, "rendezvous", "--port", "0"],
                             cwd=tmp_path, env=clean_env(), stderr=subprocess.PIPE, text=True)
    nodes = []
    try:
        port = int(read_until(store, r"listening on 0\.0\.0\.0:(\d+)")[1])
        for index in range(2):
            env = clean_env(JOB_COMPLETION_INDEX=str(index), TRAIN_NNODES="2",
                            TRAIN_RDZV_ENDPOINT=f"127.0.0.1:{port}", TRAIN_RDZV_ID="job-uid-1",
                            TRAIN_LOCAL_ADDR="127.0.0.1")
            nodes.append(subprocess.Popen(
                [sys.executable, ENTRY, "train", QUICKSTART, "train.max_steps=6", *SMALL],
                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True))
        outs = [n.communicate(timeout=limit(240))[0] for n in nodes]
        assert [n.returncode for n in nodes] == [0, 0], outs
        m = read_until(store, r"round 0 complete: (\d) node")
    finally:
        for p in [*nodes, store]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=limit(30))
    assert "is_host=false" in outs[0] and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in outs[0]
    assert "world size 2" in "".join(outs)
    assert m[1] == "2"
