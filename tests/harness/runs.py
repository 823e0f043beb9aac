"""Running the trainer for real in tests: configs, environments, runs, run directories.

Everything runs for real: `python -m train` as a subprocess, torchrun with gloo on
127.0.0.1 for more than one process.

The suite passes on any host. Subprocesses see no GPU unless a test asks for one
(:data:`NO_GPU`): tests that mean "a machine without GPUs" get one, also on a GPU host.

Time limits that guard against a hang (subprocess timeouts, waits, polling deadlines)
go through :func:`limit`, which scales them by ``TEST_TIME_SCALE`` (default 1) on a
slow or loaded machine. A helper of the harness that takes a ``timeout`` scales it
itself: its callers pass plain seconds.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import queue
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
FAKES = ROOT / "tests" / "fakes"
# How much longer than on the 2-core development machine this one may take: every time
# limit that guards against a hang is multiplied by it (limit()); never the sleeps a
# test's story needs, nor durations given to the product as config.
TIME_SCALE = float(os.environ.get("TEST_TIME_SCALE", "1"))
ENTRY = str(ROOT / "entrypoint.py")
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
# The quick start shrunk to a tiny model on a little data: seconds per run, also on 2 ranks.
SMALL = ["model.depth=1", "model.width=32", "model.heads=4", "model.context_length=32",
         "train.global_batch_size=8", "data.max_bytes=200000", "data.num_workers=0",
         "schedule.warmup_steps=2", "train.eval_batches=1", "logging.every_steps=1",
         "logging.progress=plain"]

# A GPT small enough that a run of 20 steps takes a couple of seconds on one core.
TINY_GPT = {
    "seed": 0,
    "model": {"kind": "gpt", "depth": 1, "width": 32, "heads": 2, "context_length": 16},
    "data": {"kind": "text", "max_bytes": 60_000, "num_workers": 0},
    "optim": {"lr": 3.0e-3},
    "schedule": {"warmup_steps": 2},
    "train": {"max_steps": 10, "global_batch_size": 8, "eval_batches": 2},
    "logging": {"every_steps": 1, "progress": "plain"},
}

TINY_MLP = {
    "seed": 0,
    "model": {"kind": "mlp", "depth": 2, "width": 32},
    "data": {"kind": "synthetic", "num_samples": 512, "shape": [16], "num_classes": 4,
             "num_workers": 0},
    "optim": {"lr": 1.0e-2},
    "train": {"max_steps": 10, "global_batch_size": 16, "eval_batches": 2},
    "logging": {"every_steps": 1, "progress": "plain"},
}


def limit(seconds: float) -> float:
    """A time limit that guards against a hang, scaled to this machine (TEST_TIME_SCALE)."""
    return seconds * TIME_SCALE


def merge(base: dict, extra: dict) -> dict:
    out = json.loads(json.dumps(base))
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def write_config(path: Path, tree: dict) -> Path:
    path.write_text(yaml.safe_dump(tree))
    return path


# What a machine without GPUs looks like to the launcher and to torch, on any host:
# the container runtime gave no NVIDIA GPUs, and CUDA/HIP see none.
NO_GPU = {"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
# Variables of the host that would change what a test means.
HOST_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "PET_", "TORCHELASTIC",
                 "JOB_COMPLETION", "TRAIN_", "CUDA_VISIBLE", "NVIDIA_VISIBLE", "ROCR_", "HIP_",
                 "OMP_NUM", "MLFLOW_", "WANDB_")


def clean_env(gpu: bool = False, **extra: str) -> dict:
    """The host's environment without launch or visibility variables; no GPU unless asked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(HOST_PREFIXES)}
    if not gpu:
        env.update(NO_GPU)
    env.update(extra)
    return env


def worker_env(extra: dict | None = None, gpu: bool = False) -> dict:
    env = clean_env(gpu, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.update(extra or {})
    return env


@functools.cache
def usable_gpus() -> int:
    """GPUs torch can use here, asked in a subprocess (this process never starts CUDA)."""
    try:
        count = "import torch; print(torch.cuda.device_count())"
        out = subprocess.run([sys.executable, "-c", count],
                             capture_output=True, text=True, timeout=limit(120),
                             env=clean_env(gpu=True))
        return int(out.stdout.strip() or 0)
    except (subprocess.SubprocessError, ValueError):
        return 0


def run_train(config: Path, *overrides: str, nproc: int = 1, timeout: int = 240,
              env: dict | None = None, gpu: bool = False) -> subprocess.CompletedProcess:
    """`python -m train` for one process, torchrun (gloo, 127.0.0.1) for more."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "train", str(config), *overrides]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "train", str(config), *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=worker_env(env, gpu=gpu), capture_output=True,
                          text=True, timeout=limit(timeout))


def entry(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300
          ) -> subprocess.CompletedProcess:
    """``entrypoint.py ARGS`` as a user runs it, in ``cwd``, with :func:`clean_env` unless
    ``env`` is given."""
    return subprocess.run([sys.executable, ENTRY, *args], cwd=cwd, env=env or clean_env(),
                          capture_output=True, text=True, timeout=limit(timeout))


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# What torchrun, or a rank it stops after another failed, would add to a failure's line.
STOP_NOISE = ("SIGTERM", "closing signal", "Traceback", "ChildFailedError", "worker(s) failed")


def failure_lines(console: str, error: str) -> list[str]:
    """The console's lines that say ``error``, and any of :data:`STOP_NOISE`: a failure of
    several processes is said once, in the launcher's last line."""
    return [ln for ln in console.splitlines()
            if error in ln or any(noise in ln for noise in STOP_NOISE)]


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Until ``predicate()`` is true; fails saying ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + limit(timeout)
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


_STDERR_LINES: dict[int, queue.Queue] = {}


def read_until(proc: subprocess.Popen, pattern: str, timeout: float = 30) -> re.Match:
    """The next stderr line of a long-lived process matching pattern, with a real timeout
    (a bare readline() blocks forever on a server that stays silent)."""
    lines = _STDERR_LINES.get(proc.pid)
    if lines is None:
        lines = _STDERR_LINES[proc.pid] = queue.Queue()

        def pump() -> None:
            for line in proc.stderr:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
    timeout = limit(timeout)
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            break
        if line is None:
            raise AssertionError(f"exited before a line matching {pattern!r}")
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r} within {timeout} s")


def installed(*packages: str) -> bool:
    """Can this interpreter import every one of ``packages``?"""
    return all(importlib.util.find_spec(p) is not None for p in packages)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}


def tiny_run_config(tmp_path: Path, **train) -> Path:
    """TINY_GPT with ``train`` overrides and a checkpoint every 2 steps, its runs in
    ``tmp_path``/runs; the config file (the run-file tests')."""
    return write_config(tmp_path / "run.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path / "runs")}, "train": train,
        "checkpoint": {"every_steps": 2}}))


STRATEGY_STEPS = 8


def strategy_config(tmp_path: Path, **extra) -> Path:
    """TINY_GPT for STRATEGY_STEPS steps, a checkpoint every 4, its runs in ``tmp_path``;
    ``extra`` sections on top. The config file (the parallel strategies' tests)."""
    tree = merge(TINY_GPT, {"output": {"dir": str(tmp_path)},
                            "train": {"max_steps": STRATEGY_STEPS},
                            "checkpoint": {"every_steps": 4}, **extra})
    return write_config(tmp_path / "c.yaml", tree)


def lock_pins(path: Path) -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes) for every requirement in a pip-compile lock."""
    text = path.read_text()
    pins = {}
    pin = r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:[ \t]*\\\n[ \t]+--hash=sha256:[0-9a-f]{64})*)"
    for m in re.finditer(pin,
                         text, re.M):
        pins[m.group(1).lower()] = (m.group(2), m.group(3).count("--hash="))
    requirement_lines = [ln for ln in text.splitlines() if re.match(r"^[A-Za-z0-9]", ln)]
    assert len(requirement_lines) == len(pins), f"{path.name}: unparsed requirement lines"
    return pins


def slow_state_writes(seconds: int) -> str:
    """A sitecustomize.py (its folder put first on PYTHONPATH) that makes every write of
    a checkpoint's state.pt take ``seconds`` longer, in every process that imports the
    checkpoint store: a stop checkpoint that needs its grace period."""
    return patched_on_import("train.checkpoint.store", f"""
real = module.save_object
def slow(storage, name, obj):
    digest = real(storage, name, obj)
    if name.endswith("/state.pt"):
        time.sleep({seconds})
    return digest
module.save_object = slow
""")


def patched_on_import(name: str, patch: str) -> str:
    """A sitecustomize.py (its folder put first on PYTHONPATH) that runs ``patch`` (Python
    source; ``module`` is the module, and os, sys, time and Path are imported) once the
    module ``name`` is imported, in every process that imports it."""
    body = textwrap.indent(textwrap.dedent(patch).strip(), " " * 12)
    return f'''
import importlib.abc, importlib.util, os, sys, time
from pathlib import Path

class Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != {name!r}:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
{body}
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Patch())
'''
