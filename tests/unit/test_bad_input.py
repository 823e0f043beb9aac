"""Bad input, however odd, is one line and exit 2 from the parent before any worker
starts, with nothing written; input this machine cannot run is one line and exit 3.
The bare worker (``python -m train``) gives the same answers: it shares the checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from launcher.detection.system import free_port
from tests.harness.runs import (
    ENTRY,
    ROOT,
    TINY_GPT,
    TINY_MLP,
    clean_env,
    limit,
    merge,
    worker_env,
    write_config,
)


def alias_bomb() -> str:
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    return "\n".join(lines) + "\noptim:\n  betas: *a8\n"


def write_text_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def data_files(tmp: Path) -> dict[str, Path]:
    """Data that is broken in the ways users break it."""
    (tmp / "empty_dir").mkdir(parents=True)
    (tmp / "one_empty_file").mkdir()
    (tmp / "one_empty_file" / "a.txt").write_text("")
    np.save(tmp / "x.npy", np.zeros((10, 4), np.float32))
    np.save(tmp / "y9.npy", np.zeros(9, np.int64))
    np.save(tmp / "y_neg.npy", np.array([0, 1, -1, 0, 1, 0, 1, 0, 1, 0]))
    np.save(tmp / "objects.npy", np.array([{"a": 1}] * 10, dtype=object), allow_pickle=True)
    torch.save([1, 2, 3], tmp / "list.pt")
    # a model factory that returns no module, importable from the working directory
    (tmp.parent / "notamodule.py").write_text("def make(width=8):\n    return {'width': width}\n")
    return {k: tmp / k for k in ("empty_dir", "one_empty_file", "x.npy", "y9.npy", "y_neg.npy",
                                 "objects.npy", "list.pt")}


# (name, base tree, yaml text or None, overrides, env, expected exit, key, fragment)
CASES = [
    ("nan learning rate", TINY_GPT, None, ["optim.lr=.nan"], {}, 2, "optim.lr", "finite"),
    ("infinite eps", TINY_GPT, None, ["optim.eps=.inf"], {}, 2, "optim.eps", "finite"),
    ("5000 levels of nesting", None, "a: " + "[" * 5000 + "]" * 5000 + "\n", [], {}, 2,
     "line 1", "nested deeper than 32 levels"),
    ("a 2 MiB config", None, "# " + "x" * (2 << 20) + "\n", [], {}, 2, "<file>",
     "a config is at most 1 MiB"),
    ("alias bomb under optim.betas", None, alias_bomb(), [], {}, 2, "<file>",
     "expands to more than 100000 values"),
    ("duplicate key", None, "seed: 1\nmodel:\n  depth: 1\nseed: 2\n", [], {}, 2, "seed",
     "appears twice (lines 1 and 4)"),
    ("empty output.dir", TINY_GPT, None, ["output.dir="], {}, 2, "output.dir", "is empty"),
    ("a straggler ratio that calls every rank slow", TINY_GPT, None,
     ["logging.straggler_ratio=0.9"], {}, 2, "logging.straggler_ratio", "or 0 for off"),
    ("a global batch no machine holds", TINY_GPT, None, ["train.global_batch_size=10**13"], {}, 2,
     "train.global_batch_size", "expected an integer"),
    ("a global batch no machine holds (int)", TINY_GPT, None,
     ["train.global_batch_size=100000000000000"], {}, 2, "train.global_batch_size",
     "more than any machine holds"),
    ("PET_NPROC_PER_NODE=0", TINY_GPT, None, [],
     {"PET_NNODES": "1", "PET_RDZV_ENDPOINT": "127.0.0.1:1", "PET_NPROC_PER_NODE": "0"}, 2,
     "PET_NPROC_PER_NODE", "at least 1"),
    ("MASTER_PORT out of range", TINY_GPT, None, [], {"MASTER_PORT": "99999"}, 2, "MASTER_PORT",
     "a port 1..65535"),
    ("CUDA_VISIBLE_DEVICES=garbage", TINY_GPT, None, [], {"CUDA_VISIBLE_DEVICES": "garbage"}, 2,
     "CUDA_VISIBLE_DEVICES", "not a device index"),
    ("OMP_NUM_THREADS=0", TINY_GPT, None, [], {"OMP_NUM_THREADS": "0"}, 2, "OMP_NUM_THREADS",
     "positive integer"),
    ("text dir without files", TINY_GPT, None, ["data.path=@empty_dir"], {}, 2,
     "data.text_glob", "no file matches"),
    ("text dir with an empty file", TINY_GPT, None,
     ["data.path=@one_empty_file", "data.text_glob=*.txt"], {}, 2, "data.path",
     "0 bytes of text"),
    ("npy lengths differ", TINY_MLP, None,
     ["data.kind=tensors", "data.path=@x.npy", "data.labels_path=@y9.npy"], {}, 2,
     "data.labels_path", "need N features and N integer labels"),
    ("negative labels", TINY_MLP, None,
     ["data.kind=tensors", "data.path=@x.npy", "data.labels_path=@y_neg.npy"], {}, 2,
     "data.labels_path", "label -1 is negative"),
    ("object npy", TINY_MLP, None,
     ["data.kind=tensors", "data.path=@objects.npy", "data.labels_path=@y9.npy"], {}, 2,
     "data.path", "not a readable numeric .npy"),
    ("pt without a tensor dict", TINY_MLP, None, ["data.kind=tensors", "data.path=@list.pt"],
     {}, 2, "data.path", "must hold a dict with tensors"),
    ("a terminal escape in an unknown key", None, "optim:\n  \"lr\\e[2J\": 1\n", [], {}, 2,
     "optim.lr\\x1b[2J", "unknown key"),
    ("a newline and an escape in run.name", TINY_GPT, None, ["run.name=a\nentrypoint: ok\x1b[1m"],
     {}, 2, "run.name", "without '/' or control characters"),
    ("a newline in run.name, which YAML would fold into a space", TINY_GPT, None,
     ["run.name=a\nb"], {}, 2, "run.name", "got 'a\\nb'; a non-empty name without '/' or "
                                            "control characters"),
    # (read from its source: what the factory returns, the workers find: test_your_code.py)
    ("a model factory whose arguments do not fit", TINY_MLP, None,
     ["model.kind=custom", "model.factory=notamodule:make", "model.args={height: 4}"], {}, 2,
     "model.args", "got an unexpected keyword argument 'height'; the factory's parameters "
                   "are (width=8)"),
    ("MLflow on without a server", TINY_MLP, None, ["logging.mlflow.enabled=true"], {}, 2,
     "logging.mlflow.tracking_uri", "MLflow is enabled but has no server"),
    ("W&B mode written as YAML's off", None, "logging:\n  wandb:\n    mode: off\n", [], {}, 2,
     "logging.wandb.mode", "expected one of disabled, offline, online"),
    ("a seed numpy cannot take", TINY_GPT, None, ["seed=4294967296"], {}, 2, "seed",
     "must be <= 4294967295"),
    ("a global batch this machine cannot hold", TINY_GPT, None,
     ["train.global_batch_size=17179869184", "train.micro_batch_size=1"], {}, 3, None,
     "of memory available here"),
    ("a model whose weights alone outgrow this machine", TINY_GPT, None,
     ["model.width=65536", "model.heads=4"], {}, 3, None,
     "G parameters (model.width=65536, model.depth=1); their fp32 weights, gradients and "
     "adamw state alone take"),
]


def resolve(overrides: list[str], files: dict[str, Path]) -> list[str]:
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        out.append(f"{key}={files[value[1:]]}" if value.startswith("@") else o)
    return out


@pytest.mark.parametrize("name,tree,text,overrides,env,code,key,fragment", CASES,
                         ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_from_the_parent(tmp_path, name, tree, text, overrides, env, code,
                                               key, fragment):
    files = data_files(tmp_path / "data")
    runs = tmp_path / "runs"
    config = (write_text_config(tmp_path / "c.yaml", text) if text is not None else
              write_config(tmp_path / "c.yaml", merge(tree, {"output": {"dir": str(runs)}})))
    proc = subprocess.run([sys.executable, ENTRY, "train", str(config),
                           *resolve(overrides, files)], cwd=tmp_path, env=clean_env(**env),
                          capture_output=True, text=True, timeout=limit(60))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr[-2000:]
    assert len(lines) == 1 and len(lines[0]) < 600, proc.stderr[-2000:]
    assert lines[0].isprintable(), "what users wrote is echoed escaped"
    assert "Traceback" not in proc.stderr and "entrypoint: run" not in proc.stderr
    if key == "<file>":  # the file as a whole: no key named
        assert lines[0].startswith(f"error: {config}: ") and key not in lines[0], lines[0]
    elif key is not None:
        assert f": {key}: " in lines[0], lines[0]
    assert fragment in lines[0], lines[0]
    assert not runs.exists(), "nothing may be written"


@pytest.mark.parametrize("overrides, env, code, fragment", [
    (["distributed.backend=mpi"], {}, 3, "was built without mpi"),
    (["device=cpu", "distributed.backend=nccl"], {}, 2, "nccl needs GPUs but device is cpu"),
    (["distributed.backend=nccl"], {}, 3, "nccl needs GPUs, and none is usable here"),
    (["distributed.strategy=single"], {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2"},
     3, "runs one process, but WORLD_SIZE=2"),
    (["output.dir=@file/runs"], {}, 3, "is not writable"),
    (["optim.lr=.nan"], {}, 2, "must be a finite number"),
    ([], {"RANK": "abc"}, 2, "environment: RANK: got 'abc'; expected an integer"),
    ([], {"RANK": "2", "WORLD_SIZE": "2"}, 2, "RANK: got 2, but WORLD_SIZE=2: expected 0..1"),
    ([], {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"}, 2, "LOCAL_RANK: got 1"),
    ([], {"RANK": "1", "WORLD_SIZE": "1"}, 2, "RANK: got 1, but WORLD_SIZE=1: expected 0..0"),
    ([], {"WORLD_SIZE": "-1"}, 2, "WORLD_SIZE: got '-1'; expected an integer >= 1"),
    ([], {"WORLD_SIZE": "abc"}, 2, "WORLD_SIZE: got 'abc'; expected an integer >= 1"),
    ([], {"LOCAL_RANK": "abc"}, 2, "LOCAL_RANK: got 'abc'; expected an integer >= 0"),
    (["run.name=a\nb"], {}, 2, "run.name: got 'a\\nb'; a non-empty name without '/'"),
    ([], {"WORLD_SIZE": "2", "RANK": "1"}, 2, "environment: MASTER_ADDR: not set, but "
                                              "WORLD_SIZE=2: the processes meet at rank 0's"),
    (["model.kind=custom", "model.factory=notamodule:make", "model.args={width: 4}"], {}, 2,
     "model.factory: notamodule:make returned dict, not a torch.nn.Module"),
])
def test_the_bare_worker_gives_the_same_answers(tmp_path, overrides, env, code, fragment):
    """`python -m train` alone: no hang (mpi), no silent training (nccl on CPU), no traceback,
    and nothing written (not even the run directory's lease) before it refuses."""
    (tmp_path / "file").write_text("a file where a folder should be")
    (tmp_path / "notamodule.py").write_text("def make(width=8):\n    return {'width': width}\n")
    env = {**env, "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    overrides = [o.replace("@file", str(tmp_path / "file")) for o in overrides]
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {"output": {"dir": str(tmp_path /
                                                                                      "runs")}}))
    proc = subprocess.run([sys.executable, "-m", "train", str(config), *overrides], cwd=ROOT,
                          env=worker_env(env), capture_output=True, text=True, timeout=limit(120))
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert fragment in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_bare_worker_whose_rank_0_never_comes_is_one_line(tmp_path):
    """`WORLD_SIZE=2 RANK=1 python -m train.worker` with nothing at MASTER_ADDR:MASTER_PORT:
    after distributed.timeout_s, one line naming what it waited for, no Python traceback
    (torch's C++ store logs its own socket error before it; nothing here can silence it
    at run time)."""
    port = free_port()  # a port nothing listens on
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path / "runs")}, "distributed": {"timeout_s": 10}}))
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    proc = subprocess.run([sys.executable, "-m", "train.worker", str(config)], cwd=ROOT,
                          env=worker_env(env), capture_output=True, text=True, timeout=limit(120))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(
        f"error: rank 1: nothing answered at MASTER_ADDR:MASTER_PORT=127.0.0.1:{port} (rank "
        "0's) within distributed.timeout_s=10 s (DistNetworkError: "), proc.stderr[-2000:]
    assert proc.stderr.strip().endswith(
        "; start every rank 0..1 with the same MASTER_ADDR and MASTER_PORT, or start the job "
        "with `entrypoint.py train` (or torchrun), which starts them all")


def fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "config.yaml")
    return tmp / "config.yaml"


@pytest.mark.parametrize("make_config", [lambda tmp: Path("/dev/zero"), fifo],
                         ids=["/dev/zero", "a FIFO"])
def test_a_config_that_is_no_file_is_refused_not_read_forever(tmp_path, make_config):
    """/dev/zero would be read until memory runs out; a FIFO would wait for a writer."""
    config = make_config(tmp_path)
    proc = subprocess.run([sys.executable, ENTRY, "train", str(config)], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=limit(60))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (f"error: {config}: not a regular file (a device, "
                                   "FIFO or socket); name a YAML file")


@pytest.mark.parametrize("args, fragment", [
    (["launch", "optim.lr=1", "@script"], "command line: optim.lr: not a key of launch"),
    (["launch", "-m", "no_such_module_here"], "-m no_such_module_here: no such module"),
    (["launch", "-m", "mymod"], None),
    (["doctor", "--comm-timeout", "nan"], "--comm-timeout nan: expected seconds in (0, 3600]"),
    (["doctor", "--comm-timeout", "-1"], "--comm-timeout -1.0: expected seconds in (0, 3600]"),
    (["rendezvous", "--host", "999.1.1.1"], "--host 999.1.1.1: not an address or a name that "
                                            "resolves"),
])
def test_command_line_mistakes_are_one_line(tmp_path, args, fragment):
    """A launch override the trainer would silently ignore, a module that is not there, a
    timeout that is no duration: exit 2 before anything starts."""
    (tmp_path / "mymod.py").write_text("print('ran mymod')\n")
    (tmp_path / "script.py").write_text("print('ran script')\n")
    args = [str(tmp_path / "script.py") if a == "@script" else a for a in args]
    proc = subprocess.run([sys.executable, ENTRY, *args, f"output.dir={tmp_path / 'runs'}"]
                          if args[0] == "launch" and fragment else [sys.executable, ENTRY, *args],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                          timeout=limit(120))
    if fragment is None:  # the module found from the working directory, as the workers do
        assert proc.returncode == 0 and "ran mymod" in proc.stdout, proc.stderr[-2000:]
        return
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "runs").exists()
