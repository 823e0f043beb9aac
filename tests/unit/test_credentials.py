"""Credentials in process: every config key that could carry one refuses it (exit 2, one
line naming the environment variable to use, the secret not echoed), values that only
look alike pass, and the one function that hides credentials in what is printed
(:func:`train.core.storage.credentials.redacted`) behind every error, warning and log line.
A run, its resume and the trackers' stores grepped for planted secrets:
tests/e2e/test_credentials_runs.py.
"""

from __future__ import annotations

import json
import logging
import sys

import pytest

from tests.harness.runs import QUICKSTART, entry, merge, write_config
from train.core.config import check_checkpoint_config, load_config
from train.core.config import tracking as tracker_config
from train.core.errors import ConfigError, printable
from train.core.storage import credentials
from train.core.storage.credentials import redacted

SECRET = "plantedSECRETx9"
MLP = {"model": {"kind": "mlp"}, "data": {"kind": "synthetic"}}


def refusals(*overrides: str, tree: dict | None = None, tmp_path=None) -> dict[str, str]:
    """The config's errors by key (one line each), for a config with ``overrides``."""
    path = write_config(tmp_path / "c.yaml", merge(MLP, tree or {}))
    with pytest.raises(ConfigError) as raised:
        load_config(path, list(overrides))
    errors = getattr(raised.value, "errors", [raised.value])
    assert all(e.exit_code == 2 for e in errors)
    return {e.key: e.one_line() for e in errors}


@pytest.mark.parametrize("override, key, instead", [
    (f"logging.mlflow.tracking_uri=http://me:{SECRET}@mlflow:5000",
     "logging.mlflow.tracking_uri", "MLFLOW_TRACKING_PASSWORD"),
    (f"logging.mlflow.tracking_uri=https://{SECRET}@mlflow.example.com/",  # a token as user
     "logging.mlflow.tracking_uri", "MLFLOW_TRACKING_TOKEN"),
    (f"logging.mlflow.tracking_uri=https://mlflow/?token={SECRET}",
     "logging.mlflow.tracking_uri", "MLFLOW_TRACKING_URI"),
    (f"data.path=s3://bucket/x.bin?X-Amz-Credential={SECRET}&X-Amz-Signature={SECRET}",
     "data.path", "environment variable"),
    (f"model.args.hf_token={SECRET}", "model.args.hf_token", "environment variable"),
    (f"model.args.db={{user: me, password: {SECRET}}}", "model.args.db.password",
     "environment variable"),
    (f"data.args.servers=[{{apiKey: {SECRET}}}]", "data.args.servers",
     "environment variable"),
    (f"model.args.mirror=ftp://me:{SECRET}@host/data", "model.args.mirror",
     "environment variable"),
    (f"logging.wandb.project=https://host/#access_token={SECRET}", "logging.wandb.project",
     "environment variable"),
])
def test_every_key_that_could_carry_a_credential_refuses_it(tmp_path, override, key, instead):
    errors = refusals(override, tmp_path=tmp_path)
    assert key in errors, errors
    line = errors[key]
    assert line.startswith(f"error: command line: {key}: ") and instead in line
    assert "config.yaml, checkpoints, trackers and argv" in line
    assert SECRET not in " ".join(errors.values())


def test_a_credential_in_the_file_is_refused_with_the_file_named_and_all_at_once(tmp_path):
    errors = refusals(tree={"data": {"kind": "synthetic", "path": f"https://h/d?sig={SECRET}"},
                            "logging": {"mlflow": {"tracking_uri": f"http://u:{SECRET}@h"}}},
                      tmp_path=tmp_path)
    assert set(errors) == {"data.path", "logging.mlflow.tracking_uri"}
    assert errors["logging.mlflow.tracking_uri"].startswith(
        f"error: {tmp_path / 'c.yaml'}: logging.mlflow.tracking_uri: holds a URL with a user "
        "or password, http://***@h; ")
    assert SECRET not in " ".join(errors.values())


@pytest.mark.parametrize("tree", [
    {"logging": {"mlflow": {"tracking_uri": "http://mlflow:5000"}}},
    {"logging": {"mlflow": {"tracking_uri": "databricks"}}},
    {"data": {"path": "hf://datasets/org/name@main/train.bin"}},  # @ after the host: a revision
    {"data": {"path": "/data/user@example.com/train.bin"}},
    {"model": {"args": {"pad_token": 0, "eos_token": "<|end|>", "num_tokens": 5,
                        "token_env": "HF_TOKEN", "key": "text", "password_length": 8,
                        "secret": None, "api_key": "", "use_auth_token": True}}},
    {"model": {"args": {"url": "https://host/path?page=2&keyword=x"}}},
])
def test_values_that_only_look_alike_pass(tree):
    assert credentials.found(tree) == []


def test_the_launcher_refuses_before_anything_starts_and_never_echoes_it(tmp_path):
    config = write_config(tmp_path / "c.yaml", {"logging": {"mlflow": {
        "enabled": True, "tracking_uri": f"http://me:{SECRET}@127.0.0.1:5000"}}})
    for args in (["train", str(config)], ["train", str(config), "--dry-run"],
                 ["train", QUICKSTART, f"model.args=http://me:{SECRET}@h"],  # echoed as 'got'
                 ["doctor", str(config)], ["doctor", "--json", str(config)]):
        proc = entry(*args, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert SECRET not in proc.stdout + proc.stderr, args
        assert "***@" in proc.stdout + proc.stderr, args
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("text, shown", [
    ("http://mlflow:5000", "http://mlflow:5000"),
    (f"http://me:{SECRET}@h:5000/x", "http://***@h:5000/x"),
    (f"http://me:p@ss{SECRET}@h", "http://***@h"),  # an @ in the password: the last one
    (f"retrying 'https://{SECRET}@h/api', then \"s3://b/k?X-Amz-Signature={SECRET}&a=1\"",
     "retrying 'https://***@h/api', then \"s3://b/k?X-Amz-Signature=***&a=1\""),
    (f"https://h/cb#access_token={SECRET}&state=1", "https://h/cb#access_token=***&state=1"),
    ("no URL at all: user:pw@host", "no URL at all: user:pw@host"),
])
def test_redacted_hides_a_urls_user_password_and_query_credentials(text, shown):
    assert redacted(text) == shown


def test_redacted_walks_mappings_and_lists():
    saved = {"hf_token": SECRET, "pad_token": 0, "mirrors": [f"http://u:{SECRET}@h"],
             "db": {"password": SECRET, "host": "h"}}
    assert redacted(saved) == {"hf_token": "***", "pad_token": 0, "mirrors": ["http://***@h"],
                               "db": {"password": "***", "host": "h"}}


def test_everything_printed_passes_it():
    assert printable(f"\x1b[2J http://me:{SECRET}\n@h") == "\\x1b[2J http://***@h"
    long = "x" * 290 + f" http://me:{SECRET}@h"  # cut after hiding, never in the middle
    assert SECRET[:4] not in tracker_config.said(ValueError(long))
    assert tracker_config.shown_uri(f"https://h/?token={SECRET}") == "https://h/?token=***"
    from train.distributed.ranks import EscapingFormatter
    try:
        raise ConnectionError(f"API request to http://me:{SECRET}@h/api failed")
    except ConnectionError:
        record = logging.LogRecord("train", logging.ERROR, __file__, 1,
                                   f"failed at http://me:{SECRET}@h", None, sys.exc_info())
    line = EscapingFormatter("%(message)s").format(record)
    assert "Traceback" in line and "http://***@h/api" in line and SECRET not in line


def test_a_run_saved_with_a_credential_by_an_older_version_is_quoted_without_it(tmp_path):
    """A resume key compared with the checkpoint's own config (an older version saved
    a token in model.args): the error quotes both sides, the token hidden."""
    cfg = load_config(write_config(tmp_path / "c.yaml", MLP))
    saved = json.loads(json.dumps({"model": {"kind": "mlp", "depth": 1,
                                             "args": {"hf_token": SECRET}}}))
    with pytest.raises(ConfigError) as raised:
        check_checkpoint_config(cfg, saved, tmp_path, "c.yaml")
    assert "'hf_token': '***'" in str(raised.value) and SECRET not in str(raised.value)
