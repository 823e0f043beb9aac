"""The optional trackers in process: tracking URIs shown without credentials, any config
key as an MLflow param, a tracker failing mid-run, a missing package is exit 3 before
anything starts. Against a real ``mlflow server`` and W&B's offline files:
tests/e2e/test_trackers_runs.py.
"""

from __future__ import annotations

import pytest

from tests.harness.runs import (
    installed,
    write_config,
)
from train.core import tracker_config
from train.core.config import load_config
from train.core.errors import CannotRunHere, ConfigError
from train.observe import trackers


def test_a_tracker_package_that_is_missing_is_exit_3_before_anything_starts(tmp_path,
                                                                              monkeypatch):
    config = write_config(tmp_path / "c.yaml", {"logging": {"wandb": {"mode": "offline"}}})
    cfg = load_config(config)
    monkeypatch.setattr(tracker_config.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CannotRunHere) as raised:
        tracker_config.check(cfg, str(config), environ={})
    assert "logging.wandb.mode" in str(raised.value)
    assert "pip install wandb " in str(raised.value)
    with pytest.raises(ConfigError) as raised:
        tracker_config.check(load_config(config, ["logging.mlflow.enabled=true"]), str(config), {})
    assert raised.value.key == "logging.mlflow.tracking_uri"
    monkeypatch.undo()  # the packages are back: no error
    if not installed("mlflow"):
        return
    tracker_config.check(load_config(config, ["logging.mlflow.enabled=true",
                                        "logging.wandb.mode=disabled"]),
                   str(config), {"MLFLOW_TRACKING_URI": "http://mlflow:5000"})


@pytest.mark.parametrize("uri, shown", [
    ("http://mlflow:5000", "http://mlflow:5000"),
    ("https://user:token@mlflow.example.com/path", "https://***@mlflow.example.com/path"),
    ("http://token@10.0.0.1:5000", "http://***@10.0.0.1:5000"),
    ("databricks", "databricks"),
])
def test_tracking_uris_are_shown_without_credentials(uri, shown):
    assert tracker_config.shown_uri(uri) == shown


def test_any_config_key_becomes_a_param_mlflow_accepts():
    got = trackers.mlflow_params({"model.args.w<8>": 1, "optim.lr": 3e-4, "x": "v" * 7000,
                                  "model.args.größe": True})
    assert got == {"model.args.w_8_": "1", "optim.lr": "0.0003", "x": "v" * 6000,
                   "model.args.größe": "True"}
    if installed("mlflow"):  # MLflow's own validation agrees
        from mlflow.utils.validation import _validate_param
        for key, value in got.items():
            _validate_param(key, value)


class Flaky:
    name = "Flaky"

    def __init__(self, fail_at: int):
        self.fail_at, self.logged = fail_at, []

    def log(self, step, values):
        if step >= self.fail_at:
            raise ConnectionError("server went away")
        self.logged.append(step)

    def link(self):
        return "flaky://run"


def test_a_tracker_failing_mid_run_is_one_warning_and_the_others_go_on(caplog):
    group = trackers.Trackers.__new__(trackers.Trackers)
    flaky, steady = Flaky(fail_at=3), Flaky(fail_at=10**9)
    group.runs, group.closed_lines = {"flaky": flaky, "steady": steady}, []
    for step in range(1, 7):
        group.log(step, {"loss": 1.0})
    assert flaky.logged == [1, 2] and steady.logged == [1, 2, 3, 4, 5, 6]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "Flaky: logging failed (server went away)" in warnings[0]
    assert group.lines() == ["  Flaky          flaky://run"]
