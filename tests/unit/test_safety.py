"""Never lose work, never train on garbage: divergence, non-finite steps, unusable
checkpoints, a signal to the run's whole process group with loader workers. Real
processes (python -m train, entrypoint.py). Orphaned workers, a lost worker of a
2-process node, one writer per run directory: tests/e2e/test_safety_runs.py."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness.runs import (
    ROOT,
    TINY_GPT,
    TINY_MLP,
    clean_env,
    entry,
    last_line,
    limit,
    losses,
    merge,
    run_train,
    worker_env,
    write_config,
)
from tests.harness.stops import (
    assert_one_clean_stop,
    signal_the_group,
    sigterm_to_the_launchers_group,
)
from train.checkpoint import Checkpointer
from train.core.files import sha256_file

# SGD at lr 10 without clipping: the loss explodes and turns NaN within a few steps.
EXPLODES = {"optim": {"name": "sgd", "lr": 10.0, "grad_clip": 0.0},
            "schedule": {"warmup_steps": 0},
            "train": {"max_steps": 30}, "checkpoint": {"every_steps": 1, "keep_last": 50}}


def strict_json_lines(path: Path) -> list[dict]:
    """Every line parses as JSON without NaN or Infinity (which JSON does not have)."""
    def refuse(word):
        raise ValueError(f"{path}: {word} is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def all_finite(state_pt: Path) -> bool:
    model = torch.load(state_pt, weights_only=True)["model"]
    return all(torch.isfinite(v).all() for v in model.values() if v.is_floating_point())


# ------------------------------------------------------------------ divergence

def test_divergence_stops_at_once_and_saves_nothing_non_finite(tmp_path):
    config = write_config(tmp_path / "d.yaml", merge(TINY_GPT, {**EXPLODES,
                                                                "output": {"dir": str(tmp_path)}}))
    proc = run_train(config)
    assert proc.returncode == 4, proc.stderr[-3000:]
    line = last_line(proc.stderr)
    assert line.startswith("error: training diverged at step ") and "Traceback" not in proc.stderr
    run = tmp_path / "d"
    checkpoints = sorted((run / "checkpoints").glob("step-*"))
    assert checkpoints and all(all_finite(p / "state.pt") for p in checkpoints)
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert f"the last good checkpoint is {latest}" in line
    step = int(line.split("at step ")[1].split(":")[0])
    assert int(latest.name.split("-")[1]) == step - 1  # every step was saved until then
    assert not (run / "result.json").exists()
    rows = strict_json_lines(run / "metrics.jsonl")
    assert max(r["step"] for r in rows) < step
    # A rerun of the same attempt (a torchrun restart) diverges again at once.
    again = run_train(config, env={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert again.returncode == 4 and "resumed" not in again.stderr
    # Resumed from an earlier checkpoint with a sane learning rate, the run finishes.
    early = run / "checkpoints" / "step-2"
    fixed = run_train(config, "optim.lr=0.01", "optim.grad_clip=1.0",
                      f"checkpoint.resume_from={early}")
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert "at step 2" in fixed.stderr and not (run / "diverged.json").exists()
    assert math.isfinite(json.loads((run / "result.json").read_text())["val/loss"])
    aside = list(tmp_path.glob(f"d/checkpoints.abandoned-*/{latest.name}"))
    assert aside and all_finite(aside[0] / "state.pt"), "moved aside whole, never deleted"


def poisoned_data(tmp_path: Path, row: int = 0) -> Path:
    """Tensors data with one sample of infinities: the step that draws it has a NaN loss."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    x[row] = math.inf
    y = (x.nan_to_num(0).sum(1) > 0).long()
    torch.save({"features": x, "labels": y}, tmp_path / "poison.pt")
    return tmp_path / "poison.pt"


@pytest.mark.parametrize("mode, code", [("skip_step", 0), ("stop", 4)])
def test_a_non_finite_step_is_skipped_or_stops_the_run(tmp_path, mode, code):
    """Exactly one of the 15 steps draws the poisoned sample."""
    from train.data.order import GlobalOrder
    assert 0 in GlobalOrder(244, seed=0).take(0, 15 * 16)  # 244 training samples, seed 0
    data = poisoned_data(tmp_path)
    config = write_config(tmp_path / "p.yaml", merge(TINY_MLP, {
        "data": {"kind": "tensors", "path": str(data)}, "output": {"dir": str(tmp_path)},
        "train": {"max_steps": 15, "nonfinite": mode, "max_skipped_steps": 2,
                  "eval_batches": 0}, "checkpoint": {"every_steps": 5}}))
    proc = run_train(config)
    assert proc.returncode == code, proc.stderr[-3000:]
    run = tmp_path / "p"
    if mode == "stop":
        assert "gradient norm nan" in last_line(proc.stderr)
        return
    assert proc.stderr.count("update skipped (1 of at most 2") == 1
    rows = strict_json_lines(run / "metrics.jsonl")
    assert sum(r["loss"] is None for r in rows if "loss" in r) == 1  # NaN written as null
    state = torch.load(run / "checkpoints" / "step-15" / "state.pt", weights_only=True)
    assert state["skipped_steps"] == 1 and all_finite(run / "checkpoints" / "step-15" / "state.pt")


def test_export_refuses_non_finite_weights(tmp_path):
    run = tmp_path / "run"
    ck = Checkpointer(run, rank=0, keep_last=5)
    good = {"w": torch.ones(3)}
    ck.save(1, {"step": 1, "model": good, "config": {"model": {}}, "model_io": {}}, {})
    ck.save(2, {"step": 2, "model": {"w": torch.tensor([1.0, math.nan, 2.0])},
                "config": {"model": {}}, "model_io": {}}, {})
    out = subprocess.run([sys.executable, "-m", "train.export", str(run)], cwd=ROOT,
                         env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                         timeout=limit(120))
    assert out.returncode == 2 and "non-finite weights (w)" in last_line(out.stderr)
    assert "--step" in last_line(out.stderr) and not (run / "export").exists()
    ok = subprocess.run([sys.executable, "-m", "train.export", str(run), "--step", "1"],
                        cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True,
                        text=True, timeout=limit(120))
    assert ok.returncode == 0, ok.stderr
    assert json.loads((run / "export" / "model.json").read_text())["step"] == 1


def test_export_of_a_step_without_a_checkpoint_lists_the_steps_there_are(tmp_path):
    run = tmp_path / "run"
    ck = Checkpointer(run, rank=0, keep_last=5)
    for step in (100, 200):
        ck.save(step, {"step": step, "model": {"w": torch.ones(3)}, "config": {"model": {}},
                       "model_io": {}}, {})
    out = subprocess.run([sys.executable, "-m", "train.export", str(run), "--step", "250"],
                         cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True,
                         text=True, timeout=limit(120))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert last_line(out.stderr) == (f"error: command line: --step: {run}/checkpoints/step-250: "
                                     "no such checkpoint; this run has steps 100, 200")
    assert not (run / "export").exists()


# ------------------------------------------------------- checkpoints that do not load

@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    base = tmp_path_factory.mktemp("finished")
    config = write_config(base / "f.yaml", merge(TINY_GPT, {
        "output": {"dir": str(base)}, "train": {"max_steps": 6},
        "checkpoint": {"every_steps": 2, "keep_last": 5}}))
    proc = run_train(config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return config, base / "f"


def copy_run(finished, tmp_path: Path) -> tuple[Path, Path]:
    config, run = finished
    shutil.copytree(run, tmp_path / "f")
    return config, tmp_path / "f"


def tree_state(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("how", ["entrypoint", "worker"])
def test_no_verifiable_checkpoint_is_exit_2_and_nothing_changes(finished, tmp_path, how):
    config, run = copy_run(finished, tmp_path)
    for sums in (run / "checkpoints").glob("step-*/checksums.json"):
        sums.unlink()
    before = tree_state(run)
    more = ["train.max_steps=8", f"output.dir={tmp_path}"]
    proc = (entry("train", str(config), *more, cwd=tmp_path, timeout=240) if how == "entrypoint"
            else run_train(config, *more))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = last_line(proc.stderr)
    assert "3 checkpoint(s) and none is usable (step-6: missing or unreadable checksums.json" \
           in line and "checkpoint.resume_from=none" in line
    assert tree_state(run) == before, "nothing may be deleted or written"


def test_garbage_in_latest_is_ignored_with_a_warning(finished, tmp_path):
    config, run = copy_run(finished, tmp_path)
    (run / "checkpoints" / "latest").write_bytes(os.urandom(64))
    proc = run_train(config, "train.max_steps=8", f"output.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "latest is unreadable" in proc.stderr and "at step 6" in proc.stderr


@pytest.mark.parametrize("content", ["random bytes", "pickled object"])
def test_a_checkpoint_that_verifies_but_cannot_load_falls_back(finished, tmp_path, content):
    config, run = copy_run(finished, tmp_path)
    newest = run / "checkpoints" / "step-6"
    if content == "random bytes":
        (newest / "state.pt").write_bytes(os.urandom(4096))
    else:  # a class torch.load(weights_only=True) refuses to build
        torch.save({"step": 6, "x": ValueError("boom")}, newest / "state.pt")
    sums = json.loads((newest / "checksums.json").read_text())
    sums["state.pt"] = sha256_file(newest / "state.pt")  # the checksums match the bad file
    (newest / "checksums.json").write_text(json.dumps(sums))
    proc = run_train(config, "train.max_steps=8", f"output.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint " in proc.stderr and "step-6 is unusable (cannot be loaded" in proc.stderr
    assert "at step 4" in proc.stderr
    assert "weights_only=False" not in proc.stderr and "weights_only` set to `False" \
        not in proc.stderr


# ------------------------------------------------------ a signal to the process group

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_process_group_checkpoints_with_loader_workers(tmp_path, sig):
    """The data-loading workers get the group's signal too: they must not die (the main
    process would fail without a checkpoint) nor log it again, and must not outlive it."""
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path)}, "data": {"num_workers": 2},
        "train": {"max_steps": 100000}}))
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "train", str(config)], cwd=ROOT,
                                env=worker_env(), stdout=o, stderr=e, start_new_session=True)
    below = signal_the_group(proc, sig, out, err)
    assert len(below) >= 2, "the loader's worker processes were running"
    assert proc.returncode == 143, err.read_text()[-3000:]
    step = assert_one_clean_stop(err.read_text(), sig)
    latest = tmp_path / "c" / "checkpoints" / "latest"
    assert latest.read_text().strip() == f"step-{step}"
    again = run_train(config, f"train.max_steps={step + 1}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at step {step}" in again.stderr
    assert sorted(losses(tmp_path / "c")) == list(range(1, step + 2))


@pytest.mark.parametrize("nproc", [1])  # 2: tests/e2e/test_safety_runs.py
def test_sigterm_to_the_launchers_process_group_checkpoints_with_loader_workers(tmp_path,
                                                                                nproc):
    """kill -TERM -- -PGID of `entrypoint.py train` with data-loading workers; with two
    processes torchrun passes it on to each rank's whole group, loader workers included."""
    sigterm_to_the_launchers_group(tmp_path, nproc)


def test_a_full_disk_is_said_in_words(tmp_path):
    """torch reports a short write as "[enforce fail at inline_container.cc] unexpected pos"."""
    from train.checkpoint import write_error
    with pytest.raises(RuntimeError) as real:  # a real short write: /dev/full takes nothing
        torch.save({"w": torch.zeros(100_000)}, "/dev/full")
    (tmp_path / "checkpoints" / "step-5.partial").mkdir(parents=True)
    message = str(write_error(real.value, tmp_path / "checkpoints" / "step-5.partial" / "state.pt"))
    assert message.startswith("cannot write checkpoint step-5.partial/state.pt: ")
    assert f"is the disk holding {tmp_path / 'checkpoints'} full" in message
    assert message.endswith("the previous checkpoint is intact")
