"""The ``trainpod`` command as a user installs it: the project's wheel, built here, pip
installed into a fresh virtual environment (its declared dependencies from the package
index, torch added by the user), then run from a folder of the user's own, far from the
checkout: examples/custom_model copied out, trained, exported, loaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tests.harness.runs import ROOT, clean_env, limit


def _run(argv: list, cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=limit(timeout))


def test_the_wheel_gives_a_command_that_trains_a_project_from_its_own_folder(tmp_path):
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "-q", "-w", tmp_path / "dist", ROOT], tmp_path, clean_env())
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("trainpod-*.whl"))
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", venv], tmp_path, clean_env()).returncode == 0
    env = clean_env()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    env.pop("PYTHONPATH", None)  # nothing of the checkout: only what the wheel installed
    # --no-compile: pip's byte-compiling of every module it installs (torch's thousands)
    # was a third of this test's time; Python compiles what it imports as it imports it.
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
           "--no-compile"]
    installed = _run([*pip, wheel], tmp_path, env)
    assert installed.returncode == 0, installed.stderr[-3000:]
    project = tmp_path / "my-project"
    shutil.copytree(ROOT / "examples" / "custom_model", project)

    # torch is the user's choice of build: without it, one line saying how to add it
    bare = _run(["trainpod", "train", "config.yaml"], project, env)
    assert bare.returncode == 3, bare.stderr[-3000:]
    assert bare.stderr.count("\n") == 1 and "pip install torch --index-url" in bare.stderr
    assert not (project / "runs").exists()

    added = _run([*pip, f"torch=={torch.__version__}"], tmp_path, env)  # this machine's build
    assert added.returncode == 0, added.stderr[-3000:]
    helped = _run(["trainpod", "--help"], project, env)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: trainpod COMMAND")
    trained = _run(["trainpod", "train", "config.yaml", "train.max_steps=20",
                    "train.eval_every_steps=10", "checkpoint.every_steps=10"], project, env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "done: step 20/20" in trained.stdout, trained.stdout[-3000:]
    assert "export         trainpod export runs/waves" in trained.stdout
    exported = _run(["trainpod", "export", "runs/waves"], project, env)
    assert exported.returncode == 0, exported.stderr[-3000:]
    load = ("import train, torch; from train.export import load_model; "
            "m = load_model('runs/waves/export'); "
            "print(train.__file__); print(m(torch.zeros(1, 32)).shape)")
    loaded = _run([venv / "bin" / "python", "-c", load], project, env)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    where, shape = loaded.stdout.splitlines()
    assert where.startswith(str(venv)), where  # the installed package, not the checkout
    assert shape == "torch.Size([1, 8])"
