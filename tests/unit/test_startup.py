"""What a worker loads before and during its run: nothing of torch's compiler stack
(torch._dynamo, torch._inductor: ~800 modules, ~1.3 CPU-s a process) unless it compiles,
though torch 2.13's optimizers, DDP and state-dict API reach for it (train/compiler_stack.py
answers them), and nothing of TensorBoard's summary API. Real processes: a fresh
interpreter, and real runs of ``python -m train`` under torchrun, watched by an import
hook that only records (it loads nothing itself)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

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
# package was imported from (the innermost frames), into the JSON file named by argv[1]
# with this rank appended.
WATCHED_RUN = """
import json, os, runpy, sys, traceback
out = sys.argv.pop(1) + "." + os.environ.get("RANK", "0")
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
    """Watched package -> the stack that first imported it in any rank of real two-process
    DDP runs (4 steps with TensorBoard, evaluations and checkpoints, then a resume to
    step 6), innermost last; absent when nothing did."""
    tmp_path = tmp_path_factory.mktemp("watched")
    record = tmp_path / "first-imports.json"
    hook = WATCHED_RUN.format(watched=COMPILER + TENSORBOARD_API)
    (tmp_path / "watched.py").write_text(hook)
    for steps in (4, 6):
        config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
            "output": {"dir": str(tmp_path)}, "run": {"name": "w"},
            "train": {"max_steps": steps, "eval_every_steps": 2},
            "checkpoint": {"every_steps": 2}, "logging": {"tensorboard": True}}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(tmp_path / "watched.py"), str(record), str(config)]
        proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True,
                              text=True, timeout=limit(300))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stderr  # the second run loaded step 4
    assert list(tmp_path.glob("w/tb/train/events.out.tfevents.*"))  # TensorBoard was on
    first: dict[str, list[list[str]]] = {}
    for rank_record in sorted(tmp_path.glob("first-imports.json.*")):
        for prefix, frames in json.loads(rank_record.read_text()).items():
            first.setdefault(prefix, frames)
    return first


def test_a_default_ddp_run_never_loads_the_compiler_stack(first_imports):
    loaded = {prefix: frames[-12:] for prefix, frames in first_imports.items()
              if prefix in COMPILER}
    assert loaded == {}


def test_tensorboard_events_are_written_without_tensorboards_summary_api(first_imports):
    loaded = {prefix: frames[-6:] for prefix, frames in first_imports.items()
              if prefix in TENSORBOARD_API}
    assert loaded == {}


# With the stand-in in place: an optimizer and a "do not trace" function run without the
# compiler; then a compile loads it, a submodule import gives the one copy the package
# holds, and the function wrapped earlier is not traced (the compiled function breaks
# into two graphs around it, as torch's own disable makes it).
STAND_IN = """
import sys, torch
from train import compiler_stack
assert compiler_stack.keep_unloaded()
model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 4)).sum().backward()
opt.step()

@torch._disable_dynamo
def side(x):
    return x + 1

side(torch.ones(1))
stand_in = type(sys.modules["torch._dynamo"]).__name__ == "_StandIn"
before = sorted(m for m in sys.modules if m.startswith(("torch._dynamo.", "torch._inductor")))
import torch._dynamo.config as config
import torch._dynamo
graphs = []
def count(gm, inputs):
    graphs.append(gm)
    return gm
compiled = torch.compile(lambda x: side(x * 2) * 3, backend=count)
value = compiled(torch.ones(1)).item()
opt.step()
print(stand_in, before, config is torch._dynamo.config is sys.modules["torch._dynamo.config"],
      len(graphs), value)
"""


def test_the_stand_in_gives_way_to_the_real_compiler_when_something_compiles():
    script = textwrap.dedent(STAND_IN)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=limit(180))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "[]", "True", "2", "9.0"]
