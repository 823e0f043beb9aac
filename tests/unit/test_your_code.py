"""Your own model, data and loss trained by config, and your own script under the
launcher: the two projects in examples/, run through the real CLI from their folders.
Across processes and signals: tests/e2e/test_your_code_runs.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.harness.examples import FAST, SCRIPT
from tests.harness.procs import worker_of_rank
from tests.harness.runs import ENTRY, ROOT, clean_env, entry, limit, losses, wait_for


def test_your_model_data_and_loss_train_resume_and_export(project):
    first = entry("train", "config.yaml", *FAST, cwd=project)
    assert first.returncode == 0, first.stderr[-3000:]
    run = project / "runs" / "waves"
    ref = losses(run)
    assert len(ref) == 40 and ref[40] < ref[1] / 2  # it learns the waves
    manifest = json.loads((run / "manifest.json").read_text())
    assert sorted(manifest["user_code"]) == ["losses.py", "nets.py", "waves.py"]
    # Resume from step 20: the same losses, bitwise.
    shutil.rmtree(run / "checkpoints" / "step-30")
    shutil.rmtree(run / "checkpoints" / "step-40")
    (run / "checkpoints" / "latest").write_text("step-20\n")
    (run / "result.json").unlink()
    again = entry("train", "config.yaml", *FAST, cwd=project)
    assert again.returncode == 0 and "at step 20" in again.stderr
    assert losses(run) == ref
    # Export, then rebuild it in a fresh interpreter from the project folder.
    exported = entry("export", "runs/waves", cwd=project)
    assert exported.returncode == 0, exported.stderr
    meta = json.loads((run / "export" / "model.json").read_text())
    assert meta["model"]["factory"] == "nets:build" and meta["step"] == 40
    # the keys a custom model reads; the built-in gpt's depth/width/heads would mislead
    assert sorted(meta["model"]) == ["args", "context_length", "factory", "kind"]
    check = subprocess.run([sys.executable, "-c", """
import torch
from train.export import load_model
from waves import make_waves
model = load_model("runs/waves/export")
x, y = make_waves()[1][0]
state = torch.load("runs/waves/checkpoints/step-40/state.pt", weights_only=True)["model"]
same = all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
print(type(model).__name__, same, float(((model(x[None]) - y) ** 2).mean()))
"""], cwd=project, env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=limit(120))
    name, same, err = check.stdout.split()
    assert (name, same) == ("ResidualMLP", "True") and float(err) < 0.2, check.stderr


def broken(project: Path, name: str) -> None:
    tree = yaml.safe_load((project / "config.yaml").read_text())
    if name == "no module":
        tree["model"]["factory"] = "nowhere:build"
    elif name == "no attribute":
        tree["model"]["factory"] = "nets:make"
    elif name == "wrong args":
        tree["model"]["args"]["heigth"] = 3
    elif name == "not pairs":
        (project / "flat.py").write_text("import torch\ndef data():\n"
                                         "    return torch.arange(10.0)\n")
        tree["data"].update(factory="flat:data", args={})
    elif name == "raising data":
        (project / "bad.py").write_text("def data():\n    raise OSError('disk gone')\n")
        tree["data"].update(factory="bad:data", args={})
    elif name == "not a module":
        (project / "notamodule.py").write_text("def make():\n    return {'width': 8}\n")
        tree["model"].update(factory="notamodule:make", args={})
    elif name == "no loss":
        tree["train"]["loss"] = "losses:nothing"
    elif name == "factory without custom":
        tree["data"] = {"kind": "synthetic", "factory": "waves:make_waves"}
    (project / "config.yaml").write_text(yaml.safe_dump(tree))


@pytest.mark.parametrize("name, key, fragment", [
    ("no module", "model.factory", "cannot import nowhere"),
    ("no attribute", "model.factory", "nets has no 'make'"),
    ("wrong args", "model.args", "unexpected keyword argument 'heigth'"),
    ("no loss", "train.loss", "losses has no 'nothing'"),
    ("factory without custom", "data.factory", "only for data.kind=custom"),
])
def test_mistakes_in_your_code_are_one_line_before_any_worker(project, name, key, fragment):
    """What reading the source shows: the launcher's line, for train and --dry-run alike."""
    broken(project, name)
    for dry in ([], ["--dry-run"]):
        out = entry("train", "config.yaml", *dry, cwd=project, timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
        assert f"config.yaml: {key}: " in lines[0] and fragment in lines[0], lines[0]
    assert not (project / "runs").exists()


@pytest.mark.parametrize("name, key, fragment", [
    ("not pairs", "data.factory", "sample 0 is a Tensor; each sample must be an (input, "
                                  "target) pair"),
    ("raising data", "data.factory", "bad:data(**data.args) failed: OSError: disk gone"),
    ("not a module", "model.factory", "notamodule:make returned dict, not a torch.nn.Module"),
])
def test_what_only_running_your_code_shows_is_one_line_from_the_workers_never_restarted(
        project, name, key, fragment):
    """The launcher does not run the user's code: the workers find these before step 1,
    exit 2 with one line, and torchrun's restarts do not try again; nothing but the
    run's lease and logs is written."""
    broken(project, name)
    assert entry("train", "config.yaml", "--dry-run", cwd=project).returncode == 0
    out = entry("train", "config.yaml", "distributed.nproc_per_node=2",
                "distributed.max_restarts=2", cwd=project, timeout=180)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and f"config.yaml: {key}: " in last and fragment in last, \
        out.stderr[-3000:]
    assert "restarting the workers" not in out.stderr and "Traceback" not in out.stderr
    run = project / "runs" / "waves"
    assert not any((run / name).exists() for name in ("config.yaml", "manifest.json",
                                                      "checkpoints", "metrics.jsonl"))


def test_the_launcher_reads_your_code_and_only_the_workers_import_it(project):
    """train --dry-run and doctor import nothing of the project (a heavy import would cost
    seconds there); the workers do (each process counted by the file its import leaves)."""
    nets = project / "nets.py"
    nets.write_text("import os\nfrom pathlib import Path\n"
                    "Path(f'imported-{os.getpid()}').touch()\n" + nets.read_text())
    for args in (["train", "config.yaml", "--dry-run"], ["doctor", "config.yaml"]):
        out = entry(*args, cwd=project)
        assert out.returncode == 0, out.stderr[-2000:]
    assert not list(project.glob("imported-*"))
    out = entry("train", "config.yaml", "train.max_steps=2", "distributed.nproc_per_node=2",
                cwd=project)
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(list(project.glob("imported-*"))) == 2  # the two workers, not the launcher


# ------------------------------------------------------------------------- launch

def test_your_script_runs_on_two_processes_and_a_failing_rank_is_named(tmp_path):
    ok = entry("launch", "distributed.nproc_per_node=2", str(SCRIPT), "--steps", "20",
               "--out", str(tmp_path / "m.pt"), cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "-m launcher.torchrun --standalone" in ok.stderr and "train.script" in ok.stderr
    assert torch.load(tmp_path / "m.pt", weights_only=True)
    (tmp_path / "fail.py").write_text(
        "from train import runtime\nctx = runtime.init()\n"
        "if ctx.rank == 1:\n    raise ValueError('rank 1 refuses')\n")
    bad = entry("launch", "distributed.nproc_per_node=2", "fail.py", cwd=tmp_path)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1].startswith(
        "error: the script failed: rank 1: ValueError: rank 1 refuses; details in its log ")


def test_a_scripts_threads_and_atexit_functions_finish_before_it_exits(tmp_path):
    """The script's process ends without the interpreter's teardown, yet what a normal
    exit promises still happens, in Python's order: a non-daemon thread is joined, then
    the atexit functions run; the script's exit code is the one reported."""
    (tmp_path / "late.py").write_text(
        "import atexit, sys, threading, time\n"
        "from pathlib import Path\n"
        "def slow():\n    time.sleep(0.5)\n    Path('thread-done').touch()\n"
        "def at_exit():\n"
        "    Path('atexit-saw-thread').write_text(str(Path('thread-done').exists()))\n"
        "atexit.register(at_exit)\n"
        "threading.Thread(target=slow).start()\n"
        "sys.exit(7)\n")
    out = entry("launch", "late.py", cwd=tmp_path)
    assert out.returncode == 1 and "rank 0: exit code 7;" in out.stderr, out.stderr[-2000:]
    assert (tmp_path / "atexit-saw-thread").read_text() == "True"


def test_launch_plans_like_train_and_refuses_bad_input(tmp_path):
    plan = entry("launch", "--dry-run", "distributed.nproc_per_node=2", str(SCRIPT), "--x",
                 cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert "TRAIN_DEVICE=cpu" in plan.stdout and "TRAIN_BACKEND=gloo" in plan.stdout
    assert plan.stdout.strip().endswith(f"-m train.script {SCRIPT} --x")
    module = entry("launch", "--dry-run", "-m", "json.tool", "--help", cwd=tmp_path)
    assert module.stdout.strip().endswith("-m train.script -m json.tool --help")
    for args, fragment in ((["nope.py"], "nope.py: no such script"),
                           (["distributed.nproc_per_node=0", str(SCRIPT)], "must be >= 1"),
                           (["distributed.backend=nccl", "device=cpu", str(SCRIPT)],
                            "nccl needs GPUs")):
        out = entry("launch", *args, cwd=tmp_path)
        assert out.returncode == 2 and fragment in out.stderr.strip().splitlines()[-1], args


# A script whose ranks all-reduce until killed; each says when it has done its first
# all-reduce of an attempt (ready-RANK-RESTART).
ALL_REDUCE = """
import os, time
import torch
import torch.distributed as dist
from train import runtime
ctx = runtime.init()
t = torch.ones(4)
dist.all_reduce(t)
open(f"ready-{ctx.rank}-{os.environ['TORCHELASTIC_RESTART_COUNT']}", "w").close()
while True:
    dist.all_reduce(t)
    time.sleep(0.01)
"""


def test_your_script_killed_by_a_signal_is_named_and_a_restart_is_one_line(tmp_path):
    """kill -9 of rank 1 (found in the launcher's process tree), twice, with one restart
    allowed: one line says the restart; the failure line names rank 1 and SIGKILL, not
    "startup or rendezvous" nor rank 0 that lost its connection to it; rank 0's traceback
    stays in its log folder, off the console."""
    (tmp_path / "loop.py").write_text(ALL_REDUCE)
    proc = subprocess.Popen([sys.executable, ENTRY, "launch", "distributed.nproc_per_node=2",
                             "distributed.max_restarts=1", "loop.py"], cwd=tmp_path,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        for attempt in (0, 1):
            ready = [tmp_path / f"ready-{r}-{attempt}" for r in (0, 1)]
            wait_for(lambda ready=ready: all(p.exists() for p in ready), 120,
                     f"attempt {attempt}: the script's ranks never ran an all-reduce")
            os.kill(worker_of_rank(proc.pid, "1", "train.script"), signal.SIGKILL)
        _, err = proc.communicate(timeout=limit(120))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    said = [line for line in err.splitlines() if "restarting" in line]
    assert said == ["torchrun: rank 1 killed by SIGKILL (often out of memory: dmesg, kubectl "
                    "describe pod; or a kill -9); restarting the workers (1 of 1)"], err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the script failed: rank 1 killed by SIGKILL (often out of "
                           "memory"), err
    assert last.endswith("/attempt_1/1/stderr.log"), last
    assert "Traceback" not in err, err
    # rank 0 keeps its traceback in its log folder; torchrun may stop it while it writes
    # (its SIGTERM follows rank 1's death), so one of the two may be cut short
    kept = list((tmp_path / "runs").glob("loop/logs/*/attempt_*/0/traceback.log"))
    assert kept and any("Traceback" in k.read_text() for k in kept), kept
