"""Your own code across processes (examples/): your model on two processes follows one,
FSDP and activation checkpointing over your model's blocks, a model that marks a
function "do not compile" mid-run, a data factory that fails in both workers said once,
and a signal reaching your own script, which stops with 143.
One process: tests/unit/test_your_code.py."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

from tests.harness.examples import FAST, SCRIPT
from tests.harness.runs import (
    ENTRY,
    TINY_MLP,
    clean_env,
    entry,
    failure_lines,
    last_line,
    limit,
    losses,
    merge,
    write_config,
)

# From its 4th forward on, the model calls a function it decorates then with torch's
# public torch.compiler.disable(reason=...): with compile off, torch._dynamo is the
# trainer's stand-in until then (train/distributed/compiler_stack.py), and the decorator
# form loads the real one mid-run. Each rank records which module it met, before and after.
LATE_DISABLE = """
import os, sys
import torch
from torch import nn


class LateDisable(nn.Module):
    def __init__(self, inputs, outputs, record):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inputs, 32), nn.ReLU(), nn.Linear(32, outputs))
        self.calls, self.record = 0, record

    def forward(self, x):
        self.calls += 1
        if self.calls < 4:
            return self.net(x)
        before = type(sys.modules["torch._dynamo"]).__name__

        @torch.compiler.disable(reason="outside any graph")
        def scaled(y):
            return y * 1.0

        if self.calls == 4:
            after = type(sys.modules["torch._dynamo"]).__name__
            path = os.path.join(self.record, "rank-" + os.environ["RANK"])
            with open(path, "w") as f:
                f.write(before + " " + after)
        return scaled(self.net(x))


def build(inputs, outputs, record):
    return LateDisable(inputs, outputs, record)
"""


def test_your_model_may_mark_a_function_do_not_compile_mid_run(tmp_path):
    """DDP on two processes, compile off: torch.compiler.disable's decorator form from
    the 4th forward on loads torch's compiler mid-run, and training, its checkpoints and
    evaluations go on to the end."""
    (tmp_path / "late.py").write_text(LATE_DISABLE)
    write_config(tmp_path / "c.yaml", merge(TINY_MLP, {
        "output": {"dir": str(tmp_path / "runs")},
        "model": {"kind": "custom", "factory": "late:build",
                  "args": {"inputs": 16, "outputs": 4, "record": str(tmp_path)}},
        "train": {"max_steps": 8, "eval_every_steps": 4},
        "checkpoint": {"every_steps": 4}, "distributed": {"nproc_per_node": 2}}))
    out = entry("train", "c.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank-{rank}").read_text() == "_StandIn module"
    assert sorted(losses(next((tmp_path / "runs").iterdir()))) == list(range(1, 9))


# A data factory that fails where it runs: in the workers (the launcher reads its source).
BROKEN = """
def make(**args):
    raise ValueError("no such table: samples")
"""


def test_your_model_on_two_processes_follows_one(project):
    one = entry("train", "config.yaml", *FAST, "train.max_steps=20", "run.name=one",
                cwd=project)
    two = entry("train", "config.yaml", *FAST, "train.max_steps=20", "run.name=two",
                "distributed.nproc_per_node=2", cwd=project)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    a, b = losses(project / "runs" / "one"), losses(project / "runs" / "two")
    assert all(abs(a[s] - b[s]) < 1e-5 for s in a)


def test_fsdp_and_activation_checkpointing_use_the_models_blocks(project):
    out = entry("train", "config.yaml", *FAST, "train.max_steps=10", "run.name=fsdp",
                "distributed.strategy=fsdp", "memory.activation_checkpointing=full",
                cwd=project)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "activation checkpointing on 2 blocks" in out.stderr


def test_a_factory_failing_in_two_workers_is_said_once(project):
    """Both workers meet the error: the console says it once, in the launcher's last line,
    naming the first rank and the file that keeps the factory's traceback; exit 2, as
    with one process."""
    (project / "broken.py").write_text(BROKEN)
    out = entry("train", "config.yaml", "data.factory=broken:make",
                "distributed.nproc_per_node=2", cwd=project)
    assert out.returncode == 2, out.stderr[-3000:]
    last = last_line(out.stderr)
    assert failure_lines(out.stdout + out.stderr, "no such table") == [last], out.stderr
    assert last.startswith("error: config.yaml: data.factory: broken:make(**data.args) "
                           "failed: ValueError: no such table: samples"), last
    kept = re.search(r"\(rank [01] failed first; details in its log (\S+/attempt_0/[01]/"
                     r"traceback\.log)\)$", last)
    assert kept, last
    assert 'broken.py", line 3, in make' in (project / kept[1]).read_text()  # your traceback


def test_a_signal_reaches_your_script_which_stops_with_143(tmp_path):
    log = (tmp_path / "out.log").open("w")
    proc = subprocess.Popen([sys.executable, ENTRY, "launch", "distributed.nproc_per_node=2",
                             str(SCRIPT), "--steps", "1000000", "--out", str(tmp_path / "m.pt")],
                            cwd=tmp_path, env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + limit(120)
        while "step 20 " not in (tmp_path / "out.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "out.log").read_text()[-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(limit(60)) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (tmp_path / "out.log").read_text()
    assert "saved " in text and (tmp_path / "m.pt").exists()  # the script's own clean stop
    assert text.strip().splitlines()[-1] == "stopped by SIGTERM (forwarded to the script's " \
                                            "processes)"
