"""The optional trackers against the real things: a local ``mlflow server`` (SQLite
store, artifacts served over HTTP) on 127.0.0.1, and W&B in offline mode, whose run
files are read back record by record (tests/harness/wandbfile.py).

The property: one training run is one tracker run, however it is resumed, and the
tracker holds what metrics.jsonl holds. Without the packages (``make trackers``
installs them; CI does) these tests skip. In process: tests/unit/test_trackers.py.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.harness.kubesim import free_port
from tests.harness.mlflowserver import mlflow_server as local_mlflow
from tests.harness.runs import (
    ENTRY,
    TINY_MLP,
    clean_env,
    installed,
    limit,
    merge,
    read_metrics,
    write_config,
)

NEEDS = "needs mlflow and wandb: make trackers (CI installs them)"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` on a free 127.0.0.1 port; its URI."""
    if not installed("mlflow"):
        pytest.skip(NEEDS)
    with local_mlflow(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


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
