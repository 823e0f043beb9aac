"""A checkpointed reference run and crashes simulated on a copy of it, for the checkpoint
tests (tests/unit/test_checkpoint.py, tests/e2e/test_checkpoint_runs.py); the fixture
``checkpointed_run`` (tests/conftest.py) trains it once per test module."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.harness.runs import TINY_GPT, merge, run_train, write_config

STEPS = 20  # the reference run's length; a checkpoint every 5 steps, all 4 kept


def reference_run(base: Path) -> tuple[Path, Path]:
    """TINY_GPT with dropout for STEPS steps in ``base``: (its config, its run directory)."""
    tree = merge(TINY_GPT, {"output": {"dir": str(base)}, "model": {"dropout": 0.1},
                            "train": {"max_steps": STEPS}, "checkpoint": {"every_steps": 5,
                                                                          "keep_last": 10}})
    config = write_config(base / "ref.yaml", tree)
    proc = run_train(config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return config, base / "ref"


def rewind(run_dir: Path, to_step: int) -> None:
    """Simulate a crash right after `to_step`'s checkpoint: later checkpoints never happened."""
    ckpts = run_dir / "checkpoints"
    for path in ckpts.glob("step-*"):
        if int(path.name.split("-")[1]) > to_step:
            shutil.rmtree(path)
    (ckpts / "latest").write_text(f"step-{to_step}\n")
    (run_dir / "result.json").unlink(missing_ok=True)  # it never finished
