"""Checkpoints across processes and restarts: resumes on two processes and with a larger
global batch, background saves on two processes, a save killed mid-write, restarts of a
run started over, a rank that cannot load the chosen checkpoint, SIGTERM to one rank,
a checkpoint of another shape refused. In one process: tests/unit/test_checkpoint.py."""

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

import torch

from tests.harness.checkpoints import STEPS, rewind
from tests.harness.procs import children
from tests.harness.runs import (
    ROOT,
    TINY_GPT,
    limit,
    losses,
    merge,
    run_train,
    worker_env,
    write_config,
)
from train.checkpoint import Checkpointer


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
    _, err = agent.communicate(timeout=limit(120))
    assert err.count("stopped at step") == 2, err[-3000:]
    stopped = set(re.findall(r"stopped at step (\d+)", err))
    assert len(stopped) == 1, "both ranks must stop after the same step"
    step = int(stopped.pop())
    latest = tmp_path / "c" / "checkpoints" / "latest"
    assert latest.read_text().strip() == f"step-{step}"
    assert Checkpointer.verify(latest.parent / f"step-{step}") is None
    assert (latest.parent / f"step-{step}" / "rank-1.pt").exists()


def test_restarts_of_a_start_over_run_continue_it(tmp_path):
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path)}, "train": {"max_steps": 4},
        "checkpoint": {"every_steps": 2, "resume_from": "none"}}))
    assert run_train(config).returncode == 0
    restarted = run_train(config, "train.max_steps=6", env={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    assert "at step 4" in restarted.stderr
    assert not list((tmp_path / "c").glob("checkpoints.replaced-*"))


def test_a_larger_global_batch_on_resume_continues_at_the_next_sample(tmp_path):
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path)}, "train": {"max_steps": 5}}))
    assert run_train(config).returncode == 0
    bigger = run_train(config, "train.max_steps=7", "train.global_batch_size=16")
    assert bigger.returncode == 0, bigger.stderr[-2000:]
    assert "at step 5, sample 40" in bigger.stderr  # 5 steps x 8, not 5 x 16
    state = torch.load(tmp_path / "c" / "checkpoints" / "step-7" / "state.pt", weights_only=True)
    assert state["samples_consumed"] == 40 + 2 * 16


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
