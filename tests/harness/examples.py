"""examples/ as a user has it: the custom-model project (its own model, data and loss
beside a config.yaml) and the plain DDP script run by ``entrypoint.py launch``."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.harness.runs import ROOT

EXAMPLE = ROOT / "examples" / "custom_model"
SCRIPT = ROOT / "examples" / "ddp_script" / "train_ddp.py"
# overrides of the example's config: 40 quick steps, a checkpoint every 10
FAST = ["train.max_steps=40", "checkpoint.every_steps=10", "train.eval_every_steps=0",
        "logging.every_steps=1", "logging.progress=plain", "schedule.warmup_steps=2"]


def copy_project(tmp_path: Path) -> Path:
    """The example project, copied: the user's folder, the working directory."""
    shutil.copytree(EXAMPLE, tmp_path / "project", ignore=shutil.ignore_patterns("runs"))
    return tmp_path / "project"
