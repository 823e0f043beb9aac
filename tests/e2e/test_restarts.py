"""Restart only what a restart can fix. Real launches, real torchrun.

- a loss that cannot compare the model's outputs with the targets fails before step 1
  (on one sample) with exit 2, one line naming both shapes (said once, though both
  workers meet it), and torchrun does not restart it;
- a failure that repeats (the same error, from the same checkpoint) is restarted once,
  then no more: one line says each restart, one that it is not restarted again.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.harness.runs import (
    ENTRY,
    TINY_GPT,
    clean_env,
    failure_lines,
    limit,
    merge,
    write_config,
)

# A dataset whose sample 5 cannot be read (a corrupt record): the same step fails on
# every attempt. Every build is counted in builds.txt (the workers' only: the launcher
# reads the factory's source, it does not run it).
BROKEN_DATA = '''
import torch

class Broken(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 5:
            raise RuntimeError("record 5 is corrupt")
        return torch.full((4,), float(i % 3)), i % 3


def make():
    with open("builds.txt", "a") as f:
        f.write("built\\n")
    return Broken()
'''


def run(tmp_path: Path, config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, ENTRY, "train", str(config), *args], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=limit(600))


def test_a_loss_that_cannot_compare_is_exit_2_and_torchrun_does_not_retry_it(tmp_path):
    config = write_config(tmp_path / "run.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path / "runs")}, "train": {"loss": "mse"}}))
    out = run(tmp_path, config, "distributed.nproc_per_node=2", "distributed.max_restarts=3")
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {config}: train.loss: mse cannot compare the model's "
                           "outputs [1, 16, 256] float32 with the targets [1, 16] int64"), last
    assert "restarting the workers" not in out.stderr  # torchrun did not restart it
    # both workers met it: said once, naming the first and where its details are
    assert failure_lines(out.stdout + out.stderr, "cannot compare") == [last], out.stderr
    assert re.search(r"\(rank [01] failed first; details in its log \S+/traceback\.log\)$",
                     last), last


def test_a_failure_that_repeats_is_restarted_once_and_then_no_more(tmp_path):
    (tmp_path / "broken.py").write_text(BROKEN_DATA)
    config = write_config(tmp_path / "run.yaml", {
        "seed": 0, "model": {"kind": "mlp", "depth": 1, "width": 8},
        "data": {"kind": "custom", "factory": "broken:make", "num_classes": 3,
                 "num_workers": 0},
        "train": {"max_steps": 30, "global_batch_size": 8, "eval_batches": 0},
        "checkpoint": {"every_steps": 1}, "distributed": {"max_restarts": 3},
        "logging": {"progress": "plain"}, "output": {"dir": str(tmp_path / "runs")}})
    out = run(tmp_path, config)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert "record 5 is corrupt" in last and "not restarted again" in last, last
    # the first attempt and the one restart; none after (and none in the launcher)
    assert (tmp_path / "builds.txt").read_text().count("built") == 2
    # one line per restart, naming the rank and its error; the second ends at once
    said = [ln for ln in out.stderr.splitlines() if "restarting the worker" in ln]
    assert len(said) == 2, said
    for n, line in enumerate(said, 1):
        assert re.fullmatch(rf"entrypoint: rank 0 failed: .*record 5 is corrupt; restarting "
                            rf"the worker \({n} of 3\)", line), line
