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
from pathlib import Path

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


# Runs `python -m train` as it is; the hook records where the first module of the compiler
# stack was imported from (the innermost frames), into the file named by argv[1].
WATCHED_RUN = """
import json, runpy, sys, traceback
out = sys.argv.pop(1)
class FirstImport:
    def find_spec(self, name, path=None, target=None):
        if name.startswith({compiler!r}):
            sys.meta_path.remove(self)
            frames = [[f.filename, f.name] for f in traceback.extract_stack()]
            open(out, "w").write(json.dumps(frames))
        return None  # the normal finders import it
sys.meta_path.insert(0, FirstImport())
sys.argv[0] = "train"
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""


def first_import_of_compiler(tmp_path: Path, *overrides: str) -> list[list[str]]:
    """The stack that first imported torch's compiler stack in a real one-process run
    (3 steps, a checkpoint at the end), innermost last; [] when nothing did."""
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path)}, "train": {"max_steps": 3}}))
    record = tmp_path / "first-import.txt"
    cmd = [sys.executable, "-c", WATCHED_RUN.format(compiler=COMPILER), str(record),
           str(config), *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=limit(180))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(record.read_text()) if record.exists() else []


def test_a_default_run_loads_the_compiler_stack_only_where_torchs_optimizer_does(tmp_path):
    frames = first_import_of_compiler(tmp_path)
    if not frames:  # a torch whose optimizers no longer load it: nothing did
        return
    own = [i for i, (file, _) in enumerate(frames) if file.startswith(str(ROOT / "train"))]
    assert own, frames  # loaded below the trainer's code, not by the interpreter's start
    torch_call = frames[own[-1] + 1][0]  # the torch API the trainer's code called
    assert "/torch/optim/" in torch_call or "/torch/nn/parallel/" in torch_call, frames[-12:]
