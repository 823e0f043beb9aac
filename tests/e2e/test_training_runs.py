"""Training as users start it: the quick start's loss falls; a progress bar on request,
plain lines otherwise. Short runs: tests/unit/test_training.py."""

from __future__ import annotations

import json
import math

from tests.harness.runs import (
    ROOT,
    TINY_MLP,
    losses,
    merge,
    run_train,
    write_config,
)


def test_quickstart_loss_falls(tmp_path):
    proc = run_train(ROOT / "configs" / "quickstart.yaml", f"output.dir={tmp_path}",
                     "train.max_steps=60", "logging.progress=plain", "logging.every_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    series = losses(tmp_path / "quickstart")
    assert abs(series[1] - math.log(256)) < 0.3, "starts near uniform over 256 bytes"
    assert max(series[s] for s in range(51, 61)) < 0.6 * series[1], series
    recorded = json.loads((ROOT / "bench" / "quickstart.json").read_text())
    # the step-1 loss the README states (another stdlib moves it by a few hundredths)
    assert abs(series[1] - recorded["first_loss"]) < 0.1, (series[1], recorded)


def test_progress_bar_on_request_plain_lines_otherwise(tmp_path):
    config = write_config(tmp_path / "c.yaml", merge(TINY_MLP, {"output": {"dir": str(tmp_path)}}))
    bar = run_train(config, "train.max_steps=3", "logging.progress=bar", "run.name=bar")
    assert bar.returncode == 0
    assert "\x1b[K" in bar.stdout and "step 3/3" in bar.stdout  # redrawn in place
    plain = run_train(config, "train.max_steps=3", "logging.progress=auto", "run.name=plain")
    assert "\x1b[K" not in plain.stdout  # not a terminal: one line per logged step
    assert [line.split(" |")[0] for line in plain.stdout.splitlines() if line.startswith("step")
            and "/" in line.split(" |")[0]] == ["step 1/3", "step 2/3", "step 3/3"]
