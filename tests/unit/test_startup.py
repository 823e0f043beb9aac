"""What a worker loads before and during its run: nothing of torch's compiler stack
(torch._dynamo, torch._inductor: ~800 modules, ~1.3 CPU-s a process) unless it compiles,
though torch 2.13's optimizers, DDP and state-dict API reach for it
(train/distributed/compiler_stack.py answers them, failing open to torch's own for
anything else), and nothing of TensorBoard's summary API. Real processes: a fresh
interpreter, and real runs of ``python -m train`` under torchrun, watched by an import
hook that only records (it loads nothing itself)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.harness.runs import ROOT, TINY_GPT, limit, merge, worker_env, write_config
from train.core.config import load_config
from train.core.run.identity import WorkerIdentity
from train.distributed import compiler_stack, parallel

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


# torch's distributed state-dict API (0.7-0.9 s to import): the full format's checkpoints
# of a model that is not sharded are written and loaded without it
# (train/distributed/full_state.py)
STATE_DICT_API = ("torch.distributed.checkpoint",)


@pytest.fixture(scope="module")
def first_imports(tmp_path_factory) -> dict[str, list[list[str]]]:
    """Watched package -> the stack that first imported it in any rank of real two-process
    DDP runs (4 steps with TensorBoard, evaluations and checkpoints, then a resume to
    step 6), innermost last; absent when nothing did."""
    tmp_path = tmp_path_factory.mktemp("watched")
    record = tmp_path / "first-imports.json"
    hook = WATCHED_RUN.format(watched=COMPILER + TENSORBOARD_API + STATE_DICT_API)
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


def test_a_default_ddp_run_saves_and_resumes_without_torchs_state_dict_api(first_imports):
    loaded = {prefix: frames[-8:] for prefix, frames in first_imports.items()
              if prefix in STATE_DICT_API}
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
from train.distributed import compiler_stack
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


def _run(script: str, **env: str) -> str:
    """``script`` in a fresh interpreter (the stand-in is put in place there, never in
    this process); its last line of output."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT,
                          env=worker_env(env), capture_output=True, text=True,
                          timeout=limit(180))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


# Each answer's parameters (name, kind, default) while the stand-in is in place, then
# torch's own once the real module is loaded.
SIGNATURES = """
import inspect, json, sys, torch
from train.distributed import compiler_stack
assert compiler_stack.keep_unloaded()

def answers(dynamo):
    return {"disable": dynamo.disable, "graph_break": dynamo.graph_break,
            "is_compiling": dynamo.is_compiling,
            "utils.get_optimize_ddp_mode": dynamo.utils.get_optimize_ddp_mode}

def parameters(fn):
    return [(p.name, p.kind.name, repr(p.default))
            for p in inspect.signature(fn).parameters.values()]

ours = {name: parameters(fn) for name, fn in answers(sys.modules["torch._dynamo"]).items()}
import torch._dynamo.utils
assert type(sys.modules["torch._dynamo"]).__name__ != "_StandIn"
torchs = {name: parameters(fn) for name, fn in answers(sys.modules["torch._dynamo"]).items()}
print(json.dumps({"ours": ours, "torchs": torchs}))
"""
FAIL_OPEN = ("VAR_POSITIONAL", "VAR_KEYWORD")


def test_each_answer_takes_every_parameter_torchs_own_takes():
    """torch's parameters in torch's order, kinds and defaults (a call binds as it would
    to torch's), then *args and **kwargs: a call shape torch adds goes to torch."""
    seen = json.loads(_run(SIGNATURES))
    assert seen["ours"].keys() == seen["torchs"].keys()
    for name, torchs in seen["torchs"].items():
        ours = seen["ours"][name]
        assert [p for p in ours if p[1] not in FAIL_OPEN] == torchs, name
        assert sorted(p[1] for p in ours if p[1] in FAIL_OPEN) == sorted(FAIL_OPEN), name


# torch's public disable with a reason (the stand-in answers it and keeps the name and
# docstring, as torch's wrapping does), then call shapes it hands to the real module:
# the decorator factory (fn=None) and a module; the functions wrapped before still work.
CALLS = """
import json, sys, torch
from train.distributed import compiler_stack
assert compiler_stack.keep_unloaded()

def real():
    return type(sys.modules["torch._dynamo"]).__name__ != "_StandIn"

def double(x):
    "Twice x."
    return 2 * x

why = torch.compiler.disable(double, reason="why")
seen = [why(3), why.__name__, why.__doc__, torch._dynamo.graph_break(),
        torch.compiler.is_compiling(), real()]
later = torch._dynamo.disable(recursive=False)(double)
seen += [real(), later(4), why(5), torch.compiler.disable(reason="r")(double)(6),
         isinstance(torch.compiler.disable(torch.nn.Linear(2, 2)), torch.nn.Module)]
print(json.dumps(seen))
"""


def test_torchs_public_disable_works_in_every_call_shape_with_the_stand_in_in_place():
    assert json.loads(_run(CALLS)) == [6, "double", "Twice x.", None, False, False,
                                       True, 8, 10, 12, True]


# Off by the environment, off for a torch no test covers, on otherwise; off loads nothing.
SWITCHED = """
import os, sys
from train.distributed import compiler_stack
seen = [compiler_stack.keep_unloaded()]
os.environ["TRAIN_KEEP_COMPILER_UNLOADED"] = "1"
covered, compiler_stack.STAND_IN_TORCH = compiler_stack.STAND_IN_TORCH, ("2.12",)
seen.append(compiler_stack.keep_unloaded())
seen.append("torch._dynamo" in sys.modules)
compiler_stack.STAND_IN_TORCH = covered
seen.append(compiler_stack.keep_unloaded())
print(seen)
"""


def test_the_environment_and_an_untested_torch_turn_the_stand_in_off():
    assert _run(SWITCHED, TRAIN_KEEP_COMPILER_UNLOADED="0") == "[False, False, False, True]"


def test_the_pinned_torch_is_one_the_stand_in_is_tested_against():
    """The signature test above runs on the pinned torch: a new pin must be checked
    (and added to STAND_IN_TORCH) or the stand-in stays out of its runs."""
    make = (ROOT / "Makefile").read_text()
    pin = re.search(r"^TORCH_VERSION\s*\?=\s*(\S+)", make, re.M)[1]
    assert compiler_stack.covered(pin), (pin, compiler_stack.STAND_IN_TORCH)
    assert compiler_stack.covered(torch.__version__)  # the torch these tests ran on
    assert not compiler_stack.covered("2.12.1+cu126") and not compiler_stack.covered("3.13.0")


def test_neither_fsdp_nor_compile_puts_the_stand_in(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(compiler_stack, "keep_unloaded", calls.append)
    monkeypatch.setattr(parallel, "_fsdp", lambda module, *rest: module)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: None)
    base = tmp_path / "c.yaml"
    base.write_text("model: {kind: mlp}\ndata: {kind: synthetic}\n")
    env = WorkerIdentity()
    for overrides in (["distributed.strategy=fsdp"], ["compile=true"], []):
        cfg = load_config(base, ["device=cpu", *overrides])
        parallel.parallelize(torch.nn.Linear(2, 2), cfg, env, torch.device("cpu"))
    assert calls == [env]
