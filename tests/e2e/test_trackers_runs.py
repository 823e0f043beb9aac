"""The optional trackers against the real things: a local ``mlflow server`` (SQLite
store, artifacts served over HTTP) on 127.0.0.1, and W&B in offline mode, whose run
files are read back record by record (tests/harness/wandbfile.py).

The property: one training run is one tracker run, however it is resumed, and the
tracker holds what metrics.jsonl holds. A server killed mid-run costs two warning lines
(and, brought back, nothing of its history), never the run's end: the run exits 0 a
bounded time after its last step, nothing of its process tree left. Without the
packages (``make trackers`` installs them; CI does) these tests skip. In process:
tests/unit/test_trackers.py and tests/unit/test_shutdown.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.detection.system import free_port
from tests.harness.mlflowserver import MlflowServer
from tests.harness.procs import alive, descendants
from tests.harness.runs import (
    ENTRY,
    TINY_MLP,
    clean_env,
    installed,
    limit,
    merge,
    read_metrics,
    wait_for,
    write_config,
)

NEEDS = "needs mlflow and wandb: make trackers (CI installs them)"


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    """One ``mlflow server`` on a free 127.0.0.1 port for the module (a test may kill it)."""
    if not installed("mlflow"):
        pytest.skip(NEEDS)
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def mlflow_server(tracking_server):
    """The server's URI; started again when a test before this one killed it."""
    if not tracking_server.answers():
        tracking_server.kill()
        tracking_server.start()
    return tracking_server.uri


def train(config: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, ENTRY, "train", str(config), *overrides],
                          cwd=config.parent, env=clean_env(**(env or {})), capture_output=True,
                          text=True, timeout=limit(300))


def leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def test_one_tracker_run_per_training_run_through_a_resume_and_an_export(tmp_path,
                                                                         mlflow_server):
    if not installed("wandb"):
        pytest.skip(NEEDS)
    from mlflow import MlflowClient

    from tests.harness.wandbfile import history, run_info
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "tracked.yaml", merge(TINY_MLP, {
        "output": {"dir": str(runs)}, "checkpoint": {"every_steps": 3},
        "logging": {"mlflow": {"enabled": True, "tracking_uri": mlflow_server,
                               "experiment": "tracked"},
                    "wandb": {"mode": "offline", "project": "trackers-test"}}}))
    first = train(config, "train.max_steps=6")
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = runs / "tracked"
    first_record = json.loads((run_dir / "trackers.json").read_text())
    second = train(config, "train.max_steps=10")  # resumes from step 6 and trains on
    assert second.returncode == 0, second.stderr[-3000:]
    exported = subprocess.run([sys.executable, ENTRY, "export", str(run_dir)], cwd=tmp_path,
                              env=clean_env(), capture_output=True, text=True, timeout=limit(300))
    assert exported.returncode == 0, exported.stderr[-3000:]
    record = json.loads((run_dir / "trackers.json").read_text())
    assert record == first_record, "the resume continued the same tracker runs"

    rows = read_metrics(run_dir)
    train_rows = {r["step"]: r for r in rows if "loss" in r}
    assert sorted(train_rows) == list(range(1, 11))

    # MLflow: one run in its experiment, finished, holding every row of metrics.jsonl
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("tracked")
    found = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in found] == [record["mlflow"]["run_id"]]
    run = found[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    history_of = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
                  for k in ("loss", "lr", "val/loss")}
    assert history_of["loss"] == pytest.approx({s: r["loss"] for s, r in train_rows.items()})
    assert history_of["lr"] == pytest.approx({s: r["lr"] for s, r in train_rows.items()})
    result = json.loads((run_dir / "result.json").read_text())
    assert history_of["val/loss"][10] == pytest.approx(result["val/loss"])
    config_tree = yaml.safe_load((run_dir / "config.yaml").read_text())
    params = run.data.params
    assert set(params) == set(leaves(config_tree))
    assert params["optim.lr"] == str(config_tree["optim"]["lr"])
    assert params["train.max_steps"] == "6", "MLflow keeps a param's first value"
    assert "changed since then: train.max_steps" in second.stderr
    # artifacts: this attempt's config, and the export, byte for byte
    got = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "got")))
    assert (got / "config.yaml").read_bytes() == (run_dir / "config.yaml").read_bytes()
    meta = json.loads((got / "export" / "model.json").read_text())
    weights = (got / "export" / "model.pt").read_bytes()
    assert hashlib.sha256(weights).hexdigest() == meta["model_pt_sha256"]
    assert weights == (run_dir / "export" / "model.pt").read_bytes()
    assert run.info.run_id in exported.stdout
    # the closing lines say where the run is, credentials never shown
    assert f"{mlflow_server}/#/experiments/{experiment.experiment_id}/runs/" \
           f"{run.info.run_id}" in second.stdout

    # W&B offline: one directory per attempt, one id, the same rows as metrics.jsonl
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{record['wandb']['id']}.wandb"
                                   for f in files)
    logged: dict[int, dict] = {}
    for f in files:
        info = run_info(f)
        assert info["exit_code"] == 0 and info["name"] == "tracked"
        assert info["config"]["optim.lr"] == config_tree["optim"]["lr"]
        logged.update(history(f))
    assert {s: row["loss"] for s, row in logged.items() if "loss" in row} == \
           pytest.approx({s: r["loss"] for s, r in train_rows.items()})
    assert logged[10]["val/loss"] == pytest.approx(result["val/loss"])
    assert f"wandb sync {files[-1].parent}" in second.stdout


def test_an_unreachable_mlflow_server_is_one_line_without_the_password(tmp_path):
    if not installed("mlflow"):
        pytest.skip(NEEDS)
    runs = tmp_path / "runs"
    closed = f"http://someone:s3cret@127.0.0.1:{free_port()}"  # nothing listens there
    config = write_config(tmp_path / "c.yaml", merge(TINY_MLP, {"output": {"dir": str(runs)}}))
    proc = train(config, "logging.mlflow.enabled=true",
                 env={"MLFLOW_TRACKING_URI": closed, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "MLflow at http://***@127.0.0.1:" in errors[0] and "logging.mlflow" in errors[0]
    assert "s3cret" not in proc.stderr + proc.stdout
    assert not list(runs.glob("*/checkpoints/step-*")), "nothing trained"


# A dataset whose loader worker stops before the batch of step GATE + 1 until the test
# says go (the files gate-GATE.waiting and gate-GATE.go in the working directory), so a
# server dies at a known step; with ``store``, the worker also reads ahead from a store
# on a plain (non-daemon) thread, as storage clients do, and that store never answers:
# the thread never ends, so the worker never finishes exiting.
GATED = """
import socket, threading, time
from pathlib import Path
import torch

LOADED = [0]  # samples this loader worker loaded (the checks before training load more)

class Gated(torch.utils.data.Dataset):
    def __init__(self, gates, store):
        self.gates, self.store = gates, store

    def __len__(self):
        return 512

    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is not None:
            LOADED[0] += 1
            for gate in self.gates:
                if LOADED[0] == gate * 16 + 1:
                    Path(f"gate-{gate}.waiting").touch()
                    while not Path(f"gate-{gate}.go").exists():
                        time.sleep(0.05)
            if self.store and not hasattr(self, "ahead"):
                self.ahead = socket.create_connection(("127.0.0.1", self.store))
                threading.Thread(target=self.ahead.recv, args=(1,)).start()
        return torch.randn(16, generator=torch.Generator().manual_seed(i)), i % 4


def make(gates=(), store=None):
    return Gated(gates, store)
"""


def gated_config(tmp_path: Path, uri: str, steps: int, gates: list[int], *,
                 store: int | None = None, shutdown_s: float) -> Path:
    (tmp_path / "gated.py").write_text(GATED)
    return write_config(tmp_path / "gated.yaml", merge(TINY_MLP, {
        "output": {"dir": str(tmp_path / "runs")},
        "data": {"kind": "custom", "factory": "gated:make", "num_workers": 1,
                 "args": {"gates": gates, "store": store}},
        "train": {"max_steps": steps, "shutdown_timeout_s": shutdown_s},
        "checkpoint": {"every_steps": 3},
        "logging": {"mlflow": {"enabled": True, "tracking_uri": uri,
                               "experiment": f"outage-{tmp_path.name}"}}}))


def start(config: Path) -> subprocess.Popen:
    with open(config.parent / "stdout.txt", "w") as out, \
            open(config.parent / "stderr.txt", "w") as err:
        return subprocess.Popen([sys.executable, ENTRY, "train", str(config)],
                                cwd=config.parent, env=clean_env(), stdout=out, stderr=err,
                                text=True)


def at_gate(proc: subprocess.Popen, folder: Path, gate: int) -> None:
    wait_for(lambda: (folder / f"gate-{gate}.waiting").exists() or proc.poll() is not None,
             120, f"training reaching step {gate}")
    assert proc.poll() is None, (folder / "stderr.txt").read_text()[-3000:]


def logged(uri: str, run_dir: Path, step: int) -> bool:
    """Has the server the loss of ``step`` yet (the sender works in the background)?"""
    from mlflow import MlflowClient
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    return any(m.step == step for m in MlflowClient(uri).get_metric_history(run_id, "loss"))


def test_a_tracking_server_killed_and_brought_back_costs_two_lines_and_no_metric(
        tmp_path, tracking_server, mlflow_server):
    from mlflow import MlflowClient
    run_dir = tmp_path / "runs" / "gated"
    proc = start(gated_config(tmp_path, mlflow_server, 9, [3, 6], shutdown_s=limit(120)))
    at_gate(proc, tmp_path, 3)
    wait_for(lambda: logged(mlflow_server, run_dir, 3), 60, "step 3 on the server")
    tracking_server.kill()
    (tmp_path / "gate-3.go").touch()
    at_gate(proc, tmp_path, 6)  # steps 4-6 trained and logged while it was gone
    tracking_server.start()  # the same address and store
    (tmp_path / "gate-6.go").touch()
    assert proc.wait(timeout=limit(300)) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]

    stdout, stderr = ((tmp_path / name).read_text() for name in ("stdout.txt", "stderr.txt"))
    assert "Retrying" not in stdout + stderr, "urllib3's retries stay off the console"
    lines = [line for line in stderr.splitlines() if "MLflow" in line]
    assert len(lines) == 2, lines
    # from the oldest step not yet sent: 4, or earlier when the kill cut a request in
    # flight (an IncompleteRead rather than a refused connection)
    assert re.search(r"MLflow unreachable from step [1-4] \(", lines[0]), lines
    assert re.search(r"MLflow back after \d+ s: [1-9]\d* metrics buffered \(sent now\), "
                     r"0 dropped$", lines[1]), lines
    assert f"MLflow         {mlflow_server}/#/experiments/" in stdout  # the summary's line
    assert "shutdown:" not in stderr
    client = MlflowClient(mlflow_server)
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    history = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    rows = {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}
    assert history == pytest.approx(rows) and sorted(rows) == list(range(1, 10))


def test_a_tracking_server_gone_for_good_and_a_stuck_loader_worker_do_not_hold_the_end(
        tmp_path, tracking_server, mlflow_server):
    run_dir = tmp_path / "runs" / "gated"
    with socket.create_server(("127.0.0.1", 0)) as silent_store:  # accepts, never answers
        config = gated_config(tmp_path, mlflow_server, 6, [3],
                              store=silent_store.getsockname()[1], shutdown_s=5)
        proc = start(config)
        at_gate(proc, tmp_path, 3)
        wait_for(lambda: logged(mlflow_server, run_dir, 3), 60, "step 3 on the server")
        tree = descendants(proc.pid)  # the worker and its loader worker
        assert len(tree) >= 2, tree
        tracking_server.kill()  # and never started again
        (tmp_path / "gate-3.go").touch()
        # the last step, the final evaluation, then 5 s of shutdown: far inside this
        assert proc.wait(timeout=limit(120)) == 0, \
            (tmp_path / "stderr.txt").read_text()[-3000:]
    assert not [pid for pid in tree if alive(pid)], "nothing of the run's tree is left"
    stdout, stderr = ((tmp_path / name).read_text() for name in ("stdout.txt", "stderr.txt"))
    assert "done: step 6/6" in stdout
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-6"
    assert "Retrying" not in stdout + stderr
    assert len(re.findall(r"MLflow unreachable from step 4 \(\[Errno \d+\] ", stderr)) == 1
    ending = [line for line in stderr.splitlines() if "shutdown:" in line]
    assert len(ending) == 1, stderr[-3000:]
    assert "train.shutdown_timeout_s=5" in ending[0]
    assert re.search(r"MLflow \(\d+ metrics unsent, its run left RUNNING on the server; "
                     r"unreachable for \d+ s\)", ending[0]), ending[0]
    assert re.search(r"DataLoader worker process \d+ \(killed", ending[0]), ending[0]
