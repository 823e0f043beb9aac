"""The optional trackers in process: tracking URIs shown without credentials, any config
key as an MLflow param, a tracker failing mid-run, a missing package is exit 3 before
anything starts. Against a real ``mlflow server`` and W&B's offline files:
tests/e2e/test_trackers_runs.py.
"""

from __future__ import annotations

import pytest

from tests.harness.runs import (
    installed,
    limit,
    wait_for,
    write_config,
)
from train.core.config import load_config, tracking
from train.core.errors import CannotRunHere, ConfigError
from train.observe import trackers
from train.observe.sender import Sender


def test_a_tracker_package_that_is_missing_is_exit_3_before_anything_starts(tmp_path,
                                                                              monkeypatch):
    config = write_config(tmp_path / "c.yaml", {"logging": {"wandb": {"mode": "offline"}}})
    cfg = load_config(config)
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CannotRunHere) as raised:
        tracking.check(cfg, str(config), environ={})
    assert "logging.wandb.mode" in str(raised.value)
    assert "pip install wandb " in str(raised.value)
    with pytest.raises(ConfigError) as raised:
        tracking.check(load_config(config, ["logging.mlflow.enabled=true"]), str(config), {})
    assert raised.value.key == "logging.mlflow.tracking_uri"
    monkeypatch.undo()  # the packages are back: no error
    if not installed("mlflow"):
        return
    tracking.check(load_config(config, ["logging.mlflow.enabled=true",
                                        "logging.wandb.mode=disabled"]),
                   str(config), {"MLFLOW_TRACKING_URI": "http://mlflow:5000"})


@pytest.mark.parametrize("uri, shown", [
    ("http://mlflow:5000", "http://mlflow:5000"),
    ("https://user:token@mlflow.example.com/path", "https://***@mlflow.example.com/path"),
    ("http://token@10.0.0.1:5000", "http://***@10.0.0.1:5000"),
    ("databricks", "databricks"),
])
def test_tracking_uris_are_shown_without_credentials(uri, shown):
    assert tracking.shown_uri(uri) == shown


def test_any_config_key_becomes_a_param_mlflow_accepts():
    got = trackers.mlflow_params({"model.args.w<8>": 1, "optim.lr": 3e-4, "x": "v" * 7000,
                                  "model.args.größe": True})
    assert got == {"model.args.w_8_": "1", "optim.lr": "0.0003", "x": "v" * 6000,
                   "model.args.größe": "True"}
    if installed("mlflow"):  # MLflow's own validation agrees
        from mlflow.utils.validation import _validate_param
        for key, value in got.items():
            _validate_param(key, value)


class Stand:
    """A tracker's run as the sender sees it: every call refused (a run deleted on the
    server), or every call taken."""

    def __init__(self, name: str, refuses: bool):
        self.name, self.refuses = name, refuses
        self.steps, self.closed = [], None

    def send_rows(self, rows):
        if self.refuses:
            raise ValueError("RESOURCE_DOES_NOT_EXIST: run deleted")
        self.steps += [step for step, _ in rows]

    @staticmethod
    def refused(exc):
        return isinstance(exc, ValueError)

    def link(self):
        return f"{self.name.lower()}://run"

    def close(self, status):
        self.closed = status


def test_a_tracker_refusing_mid_run_is_one_warning_and_the_others_go_on(caplog):
    group = trackers.Trackers.__new__(trackers.Trackers)
    runs = {"refusing": Stand("Refusing", True), "steady": Stand("Steady", False)}
    group.runs, group.closed_lines = dict(runs), []
    group.senders = {k: Sender(r.name, r.send_rows, r.refused) for k, r in runs.items()}
    for step in range(1, 7):
        group.log(step, {"loss": 1.0})  # hands over, never waits on a server
    wait_for(lambda: not group.senders["refusing"].running, 30, "the refusal")
    assert group.lines() == ["  Steady         steady://run"]
    assert group.close("FINISHED", lambda: limit(30)) == []
    assert runs["steady"].steps == [1, 2, 3, 4, 5, 6] and runs["steady"].closed == "FINISHED"
    assert runs["refusing"].closed is None, "a tracker left out is not closed"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "Refusing: logging failed (RESOURCE_DOES_NOT_EXIST: run deleted)" in warnings[0]


def test_mlflow_calls_that_fail_are_an_outage_unless_the_server_refused_them():
    if not installed("mlflow"):
        pytest.skip("needs mlflow: make trackers")
    from mlflow.exceptions import MlflowException, RestException

    def answer(code: str) -> RestException:
        return RestException({"error_code": code, "message": "m"})
    refused = trackers.MlflowRun.refused
    for code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "PERMISSION_DENIED"):
        assert refused(answer(code)), code  # retrying cannot help
    for code in ("REQUEST_LIMIT_EXCEEDED", "TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR"):
        assert not refused(answer(code)), code  # it may pass later
    # what MLflow's client raises when no server answers
    assert not refused(MlflowException("API request to http://127.0.0.1:5000/api/2.0/mlflow/"
                                       "runs/log-batch failed with exception "
                                       "HTTPConnectionPool(...): Max retries exceeded"))
    assert not refused(ConnectionRefusedError(111, "Connection refused"))
