"""Which experiment trackers a config turns on, and the checks the launcher makes
before anything starts (train/observe/trackers.py runs them; this part imports neither tracker
nor torch, so the launcher's parent process stays light)."""

from __future__ import annotations

import importlib.util
import os

from train.core.config import Config
from train.core.errors import CannotRunHere, ConfigError
from train.core.storage.credentials import redacted

MLFLOW_URI_VAR = "MLFLOW_TRACKING_URI"
# what to pip install for each tracker (import name -> distribution): the client alone
PACKAGES = {"mlflow": "mlflow-skinny", "wandb": "wandb"}


def wanted(cfg: Config) -> list[str]:
    """The tracker packages a config asks for, by import name."""
    return ((["mlflow"] if cfg.logging.mlflow.enabled else [])
            + (["wandb"] if cfg.logging.wandb.mode != "disabled" else []))


def mlflow_uri(cfg: Config, environ=os.environ) -> str | None:
    return cfg.logging.mlflow.tracking_uri or environ.get(MLFLOW_URI_VAR) or None


def check(cfg: Config, source: str, environ=os.environ) -> None:
    """Before a launch: exit 2 when MLflow has no server to talk to, exit 3 when a
    tracker's package is not installed. Finds the packages without importing them."""
    if cfg.logging.mlflow.enabled and not mlflow_uri(cfg, environ):
        raise ConfigError(source, "logging.mlflow.tracking_uri",
                          f"MLflow is enabled but has no server: set this key or "
                          f"{MLFLOW_URI_VAR} (e.g. http://mlflow:5000), or set "
                          "logging.mlflow.enabled=false")
    for package in wanted(cfg):
        if importlib.util.find_spec(package) is None:
            key = "logging.mlflow.enabled=false" if package == "mlflow" \
                else "logging.wandb.mode=disabled"
            raise CannotRunHere(f"{source}: {key.split('=')[0]}: the {package} package is not "
                                f"installed here: pip install {PACKAGES[package]} (in an "
                                f"image: a RUN line in your Dockerfile), or set {key}")


def shown_uri(uri: str) -> str:
    """A URI without its user and password (``http://user:token@host`` in
    MLFLOW_TRACKING_URI is allowed; the config key refuses it)."""
    return redacted(uri)


def said(exc: BaseException, limit: int = 300) -> str:
    """An exception as one short line, with no credentials of any URI in it (MLflow's
    messages repeat the URL they failed on, user and password included)."""
    return redacted(" ".join(str(exc).split()))[:limit]
