"""What a worker loads before its first step: nothing of torch's compiler stack
(torch._dynamo, torch._inductor: ~800 modules, ~1 CPU-s a worker) on its own account.

torch 2.13's optimizers and DDP import that stack themselves (their wrappers call into
torch._dynamo), and so does a plain hand-written loop; what the trainer must not do is
pull it in earlier or elsewhere, as an unconditional ``use_deterministic_algorithms(False)``
did. Real processes: a fresh interpreter, and a real run of ``python -m train`` watched
by an import hook that only records (it loads nothing itself)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness.runs import ROOT, TINY_GPT, limit, merge, worker_env, write_config

COMPILER = ("torch._dynamo", "torch._inductor")

SWITCHES = """
import json, sys, torch
from train.distributed.ranks import set_deterministic

def switches():
    import torch._inductor.config as inductor
    return [torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark, inductor.deterministic]

before = set(sys.modules)
set_deterministic(False)
loaded = sorted(m for m in set(sys.modules) - before if m.startswith({compiler!r}))
set_deterministic(True)
on = switches()
set_deterministic(False)
print(json.dumps({{"loaded": loaded, "on": on, "off": switches()}}))
"""


def test_determinism_off_loads_no_compiler_and_on_still_sets_every_switch():
    script = SWITCHES.format(compiler=COMPILER)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=limit(120))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["loaded"] == []
    # torch's flag, cuDNN's algorithms (no autotuning), and compiled code's (inductor)
    assert seen["on"] == [True, True, False, True]
    assert seen["off"] == [False, False, True, False]


# Runs `python -m train` as it is; the hook records where the first module of each watched
# package was imported from (the innermost frames), into the JSON file named by argv[1].
WATCHED_RUN = """
import json, runpy, sys, traceback
out = sys.argv.pop(1)
first = {{}}
class FirstImport:
    def find_spec(self, name, path=None, target=None):
        for prefix in {watched!r}:
            if name.startswith(prefix) and prefix not in first:
                first[prefix] = [[f.filename, f.name] for f in traceback.extract_stack()]
                open(out, "w").write(json.dumps(first))
        return None  # the normal finders import it
sys.meta_path.insert(0, FirstImport())
sys.argv[0] = "train"
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""
# torch's SummaryWriter and TensorBoard's summary API (with its TensorFlow stub): the
# trainer writes its event files from TensorBoard's protocol buffers alone.
TENSORBOARD_API = ("torch.utils.tensorboard", "tensorboard.summary",
                   "tensorboard.compat.tensorflow_stub")


@pytest.fixture(scope="module")
def first_imports(tmp_path_factory) -> dict[str, list[list[str]]]:
    """Watched package -> the stack that first imported it in a real one-process run
    (3 steps, TensorBoard on, a checkpoint at the end), innermost last; absent when
    nothing did."""
    tmp_path = tmp_path_factory.mktemp("watched")
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path)}, "train": {"max_steps": 3},
        "logging": {"tensorboard": True}}))
    record = tmp_path / "first-imports.json"
    cmd = [sys.executable, "-c", WATCHED_RUN.format(watched=COMPILER + TENSORBOARD_API),
           str(record), str(config)]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=limit(180))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert list(tmp_path.glob("*/tb/train/events.out.tfevents.*"))  # TensorBoard was on
    return json.loads(record.read_text()) if record.exists() else {}


def test_a_default_run_loads_the_compiler_stack_only_where_torchs_optimizer_does(
        first_imports):
    frames = first_imports.get(COMPILER[0]) or first_imports.get(COMPILER[1])
    if not frames:  # a torch whose optimizers no longer load it: nothing did
        return
    own = [i for i, (file, _) in enumerate(frames) if file.startswith(str(ROOT / "train"))]
    assert own, frames  # loaded below the trainer's code, not by the interpreter's start
    torch_call = frames[own[-1] + 1][0]  # the torch API the trainer's code called
    assert "/torch/optim/" in torch_call or "/torch/nn/parallel/" in torch_call, frames[-12:]


def test_tensorboard_events_are_written_without_tensorboards_summary_api(first_imports):
    loaded = {prefix: frames[-6:] for prefix, frames in first_imports.items()
              if prefix in TENSORBOARD_API}
    assert loaded == {}
