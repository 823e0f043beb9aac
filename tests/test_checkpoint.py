"""Checkpoints: resumed == uninterrupted, resized resumes, torn writes, SIGTERM -> 143."""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.harness.checkpoints import STEPS, rewind
from tests.harness.procs import children
from tests.harness.runs import (
    ROOT,
    TINY_GPT,
    losses,
    merge,
    read_metrics,
    run_train,
    worker_env,
    write_config,
)
from train.checkpoint import Checkpointer


def test_resumed_equals_uninterrupted_bitwise(checkpointed_run, tmp_path):
    """Dropout on: RNG states, optimizer, scheduler and data position must all be restored."""
    config, ref_dir = checkpointed_run
    run_dir = tmp_path / "ref"
    shutil.copytree(ref_dir, run_dir)
    rewind(run_dir, 10)
    proc = run_train(config, f"output.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "at step 10" in proc.stderr
    assert losses(run_dir) == losses(ref_dir)
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps == list(range(1, STEPS + 1)), "each step must appear once after a resume"


@pytest.mark.slow
def test_resume_on_two_processes_continues_the_trajectory(tmp_path):
    """Elastic resize 1 -> 2 processes: same global batch, same next samples, same losses."""
    tree = merge(TINY_GPT, {"output": {"dir": str(tmp_path)}, "train": {"max_steps": STEPS},
                            "checkpoint": {"every_steps": 10}})
    config = write_config(tmp_path / "r.yaml", tree)
    assert run_train(config).returncode == 0
    ref = losses(tmp_path / "r")
    rewind(tmp_path / "r", 10)
    proc = run_train(config, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "saved with world size 1, now 2" in proc.stderr
    got = losses(tmp_path / "r")
    assert sorted(got) == sorted(ref)
    for step in range(11, STEPS + 1):
        assert math.isclose(ref[step], got[step], rel_tol=1e-5), (step, ref[step], got[step])


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(checkpointed_run, tmp_path, caplog):
    _, ref_dir = checkpointed_run
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    newest = run_dir / "checkpoints" / f"step-{STEPS}" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # torn by a crash or a full disk
    found = Checkpointer(run_dir, rank=0, keep_last=3).newest_loadable(rank=0)
    assert found is not None and found[0].name == f"step-{STEPS - 5}"
    assert found[1]["step"] == STEPS - 5
    assert "unusable" in caplog.text


def test_latest_naming_a_missing_directory_still_loads(checkpointed_run, tmp_path):
    _, ref_dir = checkpointed_run
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    (run_dir / "checkpoints" / "latest").write_text("step-999\n")
    found = Checkpointer(run_dir, rank=0, keep_last=3).newest_loadable(rank=0)
    assert found[0].name == f"step-{STEPS}"


KILLED_WRITER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from train.checkpoint import Checkpointer
    ck = Checkpointer(Path(sys.argv[1]), rank=0, keep_last=2)
    step = 0
    while True:
        step += 1
        blob = torch.full((4_000_000,), float(step))  # 16 MB: writes take a while
        ck.save(step, {"step": step, "model": {"w": blob}}, {"rng": torch.get_rng_state()})
        print(step, flush=True)
""")


@pytest.mark.slow
def test_killed_mid_write_still_loads(tmp_path):
    """SIGKILL at random moments of a save loop: the newest checkpoint found is always whole."""
    rng = random.Random(0)
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    for attempt in range(4):
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")], cwd=ROOT,
                                env=worker_env(), stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # at least one checkpoint exists
        time.sleep(rng.uniform(0.0, 0.5))
        proc.kill()
        proc.wait()
        proc.stdout.close()
        found = Checkpointer(tmp_path / "run", rank=0, keep_last=2).newest_loadable(rank=0)
        assert found is not None, f"attempt {attempt}: nothing loadable"
        path, shared, _ = found
        step = shared["step"]
        assert path.name == f"step-{step}"
        assert torch.all(shared["model"]["w"] == float(step))


def test_sigterm_checkpoints_and_exits_143_then_resumes(tmp_path):
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path)}, "train": {"max_steps": 100000}}))
    proc = subprocess.Popen([sys.executable, "-m", "train", str(config)], cwd=ROOT,
                            env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    for line in proc.stdout:
        if line.startswith("step 3/"):
            break
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "stopped at step" in err
    run_dir = tmp_path / "c"
    stopped_at = max(losses(run_dir))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{stopped_at}"
    again = run_train(config, f"train.max_steps={stopped_at + 2}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"at step {stopped_at}" in again.stderr
    assert sorted(losses(run_dir)) == list(range(1, stopped_at + 3))


def test_resume_from_none_starts_fresh(checkpointed_run, tmp_path):
    config, ref_dir = checkpointed_run
    shutil.copytree(ref_dir, tmp_path / "ref")
    proc = run_train(config, f"output.dir={tmp_path}", "checkpoint.resume_from=none",
                     "train.max_steps=3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed" not in proc.stderr
    assert sorted(losses(tmp_path / "ref")) == [1, 2, 3]
    run_dir = tmp_path / "ref"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-3"]
    aside = list(run_dir.glob("checkpoints.replaced-*"))
    assert len(aside) == 1 and (aside[0] / f"step-{STEPS}").is_dir(), "kept, not deleted"
    again = run_train(config, f"output.dir={tmp_path}", "train.max_steps=4")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "at step 3" in again.stderr, "a later resume continues the new attempt"


@pytest.mark.slow
def test_async_save_on_two_processes_writes_complete_checkpoints(tmp_path):
    config = write_config(tmp_path / "a.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path)}, "train": {"max_steps": 9},
        "checkpoint": {"every_steps": 3, "keep_last": 5, "async_save": True}}))
    proc = run_train(config, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpts = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-3", "step-6", "step-9"]
    for step in (3, 6, 9):
        assert Checkpointer.verify(ckpts / f"step-{step}") is None
        assert sorted(p.name for p in (ckpts / f"step-{step}").iterdir()) == \
            ["checksums.json", "rank-0.pt", "rank-1.pt", "state.pt"]
    ref = losses(tmp_path / "a")
    rewind(tmp_path / "a", 3)
    again = run_train(config, nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert losses(tmp_path / "a") == ref


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path)}, "train": {"max_steps": 100000}}))
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node=2", "-m", "train", str(config)], cwd=ROOT,
                             env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    for line in agent.stdout:
        if line.startswith("step 3/"):
            break
    workers = children(agent.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGTERM)  # one rank only, as when one process is signalled
    _, err = agent.communicate(timeout=120)
    assert err.count("stopped at step") == 2, err[-3000:]
    stopped = set(re.findall(r"stopped at step (\d+)", err))
    assert len(stopped) == 1, "both ranks must stop after the same step"
    step = int(stopped.pop())
    latest = tmp_path / "c" / "checkpoints" / "latest"
    assert latest.read_text().strip() == f"step-{step}"
    assert Checkpointer.verify(latest.parent / f"step-{step}") is None
    assert (latest.parent / f"step-{step}" / "rank-1.pt").exists()


def test_resuming_with_a_different_model_is_bad_input(checkpointed_run, tmp_path):
    """Through the entrypoint: the parent refuses before any worker starts."""
    config, ref_dir = checkpointed_run
    shutil.copytree(ref_dir, tmp_path / "ref")
    before = sorted(p.name for p in (tmp_path / "ref" / "checkpoints").iterdir())
    proc = subprocess.run([sys.executable, "entrypoint.py", "train", str(config),
                           f"output.dir={tmp_path}", "model.width=64"], cwd=ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {config}: model.width: differs from the run being resumed")
    assert "model.width 32 -> 64" in line and "checkpoint.resume_from=none" in line
    assert sorted(p.name for p in (tmp_path / "ref" / "checkpoints").iterdir()) == before
    fresh = run_train(config, f"output.dir={tmp_path}", "model.width=64",
                      "checkpoint.resume_from=none", "train.max_steps=2")
    assert fresh.returncode == 0, fresh.stderr[-2000:]


def _saver(run_dir: Path, keep_last: int) -> Checkpointer:
    return Checkpointer(run_dir, rank=0, keep_last=keep_last)


def test_prune_keeps_latest_and_moves_an_abandoned_trajectory_aside(tmp_path):
    ck = _saver(tmp_path, keep_last=10)
    for step in (5, 10, 15, 20):
        ck.save(step, {"step": step}, {})
    (tmp_path / "checkpoints" / "latest").write_text("step-10\n")  # resumed from step 10
    _saver(tmp_path, keep_last=1).save(13, {"step": 13}, {})
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-13"], "15 and 20 belong to the abandoned trajectory"
    aside = list(tmp_path.glob("checkpoints.abandoned-*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step-15", "step-20"]
    assert Checkpointer.verify(aside[0] / "step-20") is None  # moved whole, never deleted
    assert _saver(tmp_path, 1).newest_loadable(0)[1]["step"] == 13


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    ck = _saver(tmp_path, keep_last=1)
    ck.save(5, {"step": 5, "v": 1}, {})
    ck.save(5, {"step": 5, "v": 2}, {})
    assert ck.newest_loadable(0)[1]["v"] == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-5"]


@pytest.mark.slow
def test_restarts_of_a_start_over_run_continue_it(tmp_path):
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path)}, "train": {"max_steps": 4},
        "checkpoint": {"every_steps": 2, "resume_from": "none"}}))
    assert run_train(config).returncode == 0
    restarted = run_train(config, "train.max_steps=6", env={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    assert "at step 4" in restarted.stderr
    assert not list((tmp_path / "c").glob("checkpoints.replaced-*"))


@pytest.mark.slow
def test_a_larger_global_batch_on_resume_continues_at_the_next_sample(tmp_path):
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path)}, "train": {"max_steps": 5}}))
    assert run_train(config).returncode == 0
    bigger = run_train(config, "train.max_steps=7", "train.global_batch_size=16")
    assert bigger.returncode == 0, bigger.stderr[-2000:]
    assert "at step 5, sample 40" in bigger.stderr  # 5 steps x 8, not 5 x 16
    state = torch.load(tmp_path / "c" / "checkpoints" / "step-7" / "state.pt", weights_only=True)
    assert state["samples_consumed"] == 40 + 2 * 16


def test_a_rerun_after_the_final_checkpoint_finishes_the_run(checkpointed_run, tmp_path):
    config, ref_dir = checkpointed_run
    shutil.copytree(ref_dir, tmp_path / "ref")
    (tmp_path / "ref" / "result.json").unlink()  # killed after the last checkpoint
    proc = run_train(config, f"output.dir={tmp_path}")
    assert proc.returncode == 0 and "nothing to do" in proc.stderr
    assert "val/loss" in (tmp_path / "ref" / "result.json").read_text()


def test_logged_lr_is_the_rate_the_update_used(checkpointed_run):
    _, ref_dir = checkpointed_run
    rows = {r["step"]: r for r in read_metrics(ref_dir) if "lr" in r}
    peak = TINY_GPT["optim"]["lr"]
    assert math.isclose(rows[1]["lr"], peak / 2) and math.isclose(rows[2]["lr"], peak)


SITE_PATCH = textwrap.dedent("""
    import os
    if os.environ.get("RANK") == "1":
        from train.checkpoint import reader
        real = reader.load
        def load(path, rank):
            if path.name == "step-6":
                raise MemoryError("simulated: host out of memory while loading")
            return real(path, rank)
        reader.load = load
""")


@pytest.mark.slow
def test_a_rank_that_cannot_load_the_chosen_checkpoint_fails_instead_of_diverging(tmp_path):
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path)}, "train": {"max_steps": 6},
        "checkpoint": {"every_steps": 3}}))
    assert run_train(config, nproc=2).returncode == 0
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITE_PATCH)
    proc = run_train(config, "train.max_steps=9", nproc=2,
                     env={"PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}"})
    assert proc.returncode != 0
    assert "step-3" not in proc.stderr, "no rank may fall back to an older checkpoint alone"
    assert "MemoryError" in proc.stderr


@pytest.mark.slow
def test_worker_refuses_a_checkpoint_of_another_shape_and_leaves_config_yaml(checkpointed_run,
                                                                            tmp_path):
    """Explicit resume_from skips the parent's config.yaml check; the worker compares the
    checkpoint's own config, and writes nothing before the resume succeeded."""
    config, ref_dir = checkpointed_run
    shutil.copytree(ref_dir, tmp_path / "ref")
    saved = (tmp_path / "ref" / "config.yaml").read_text()
    ckpt = tmp_path / "ref" / "checkpoints" / "step-10"
    for change, key in (("model.width=64", "model.width"), ("optim.name=sgd", "optim.name")):
        proc = run_train(config, f"output.dir={tmp_path}", change,
                         f"checkpoint.resume_from={ckpt}")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(
            f"error: {config}: {key}: differs from the run being resumed")
        assert (tmp_path / "ref" / "config.yaml").read_text() == saved
