"""The ``logging.*`` keys: the console, metrics.jsonl, TensorBoard, stragglers and the
experiment trackers (MLflow, Weights & Biases)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from train.core.config.fields import AUTO, opt


@dataclass(kw_only=True)
class MlflowConfig:
    enabled: bool = opt(False, "Log params, metrics, config.yaml and exports to an MLflow "
                               "server (pip install mlflow-skinny).")
    tracking_uri: str | None = opt(None, "Tracking server, e.g. http://mlflow:5000; default: "
                                         "MLFLOW_TRACKING_URI. A user, password or token in it "
                                         "is refused: MLflow's environment variables carry "
                                         "them (MLFLOW_TRACKING_USERNAME, ...).")
    experiment: str | None = opt(None, "Experiment name, created when missing; default: "
                                       "MLFLOW_EXPERIMENT_NAME, else MLflow's Default.")


@dataclass(kw_only=True)
class WandbConfig:
    mode: Literal["disabled", "offline", "online"] = opt(  # W&B's own mode names
        "disabled", "Weights & Biases (pip install wandb): offline writes "
               "RUN_DIR/wandb/ for `wandb sync`; online uploads (needs WANDB_API_KEY).")
    project: str | None = opt(None, "W&B project; default: WANDB_PROJECT, else W&B's own.")


@dataclass(kw_only=True)
class LoggingConfig:
    every_steps: int = opt(10, "Console line, metrics.jsonl row and TensorBoard scalars every "
                               "N steps.", ge=1)
    progress: Literal["auto", "bar", "plain"] = opt(AUTO, "Console style; auto: a live bar on "
                                                          "a terminal, plain lines otherwise.")
    tensorboard: bool = opt(True, "Write TensorBoard events to the run's tb/ directory.")
    straggler_ratio: float = opt(1.3, "Name a rank whose data wait or compute per step is "
                                      "this many times the other ranks' median; on several "
                                      "nodes, time the links when the communication wait "
                                      "grows this many times more than the rest of the step "
                                      "since earlier in the run (0 = both off).", ge=0.0)
    straggler_steps: int = opt(30, "Stragglers and the communication wait are judged over "
                                   "the last N steps (and 10 s at least), by the median "
                                   "logging interval: one slow step now and then is no alarm.",
                               ge=1)
    mlflow: MlflowConfig = opt(MlflowConfig, "MLflow tracking (optional).", factory=True)
    wandb: WandbConfig = opt(WandbConfig, "Weights & Biases tracking (optional).", factory=True)
