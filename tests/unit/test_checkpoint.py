"""Checkpoints in one process: resumed == uninterrupted, torn or corrupt checkpoints,
prune and abandoned trajectories, SIGTERM -> 143, a failed write of one rank leaves no
partial checkpoint. Across processes and restarts:
tests/e2e/test_checkpoint_runs.py."""

from __future__ import annotations

import errno
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.harness.checkpoints import STEPS, rewind
from tests.harness.runs import (
    ROOT,
    TINY_GPT,
    limit,
    losses,
    merge,
    read_metrics,
    run_train,
    worker_env,
    write_config,
)
from train.checkpoint import Checkpointer, retention
from train.core.run import rundir


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
    _, err = proc.communicate(timeout=limit(60))
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


def test_resuming_with_a_different_model_is_bad_input(checkpointed_run, tmp_path):
    """Through the entrypoint: the parent refuses before any worker starts."""
    config, ref_dir = checkpointed_run
    shutil.copytree(ref_dir, tmp_path / "ref")
    before = sorted(p.name for p in (tmp_path / "ref" / "checkpoints").iterdir())
    proc = subprocess.run([sys.executable, "entrypoint.py", "train", str(config),
                           f"output.dir={tmp_path}", "model.width=64"], cwd=ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=limit(120))
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
    resumed = _saver(tmp_path, keep_last=1)
    resumed.save(13, {"step": 13}, {})
    resumed.wait()  # the pruned ones are deleted by a thread
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-13"], "15 and 20 belong to the abandoned trajectory"
    aside = list(tmp_path.glob("checkpoints.abandoned-*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step-15", "step-20"]
    assert Checkpointer.verify(aside[0] / "step-20") is None  # moved whole, never deleted
    assert _saver(tmp_path, 1).newest_loadable(0)[1]["step"] == 13


def test_pruned_checkpoints_are_deleted_and_one_a_killed_process_left_goes_at_the_next_start(
        tmp_path):
    ck = _saver(tmp_path, keep_last=1)
    for step in (1, 2, 3):
        ck.save(step, {"step": step}, {})
    ck.wait()
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-3"]
    # killed while deleting step-2: renamed first, so never a checkpoint to resume
    shutil.copytree(folder / "step-3", folder / "step-2.pruned")
    (folder / "latest").unlink()
    assert [p.name for p in rundir.candidates(folder)] == ["step-3"]
    retention.remove_leftovers(ck.storage)
    assert sorted(p.name for p in folder.iterdir()) == ["step-3"]


def test_a_disk_turned_read_only_after_a_seal_keeps_the_checkpoint_and_old_ones(
        tmp_path, monkeypatch, caplog):
    """The seal landed, then the disk refused renames and deletes: the save succeeds
    (its checkpoint is whole), the old checkpoints stay, and no thread dies loudly."""
    ck = _saver(tmp_path, keep_last=1)
    ck.save(1, {"step": 1}, {})
    real_replace = os.replace

    def read_only_for_pruning(src, dst, *args, **kwargs):
        if str(dst).endswith(retention.PRUNED):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(src))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", read_only_for_pruning)
    ck.save(2, {"step": 2}, {})
    ck.wait()
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-1", "step-2"]
    assert ck.newest_loadable(0)[1]["step"] == 2
    assert "could not remove old checkpoints" in caplog.text and "Read-only" in caplog.text


def test_with_replica_groups_only_a_stale_partial_is_a_leftover(tmp_path):
    """Replica groups share the folder: a partial another live group writes now stays
    (it would fail its save), one unchanged for longer than a writer pauses goes."""
    ck = Checkpointer(tmp_path, rank=0, keep_last=1, leftovers_age_s=600)
    ck.save(1, {"step": 1}, {})
    folder = tmp_path / "checkpoints"
    (folder / "step-2.partial").mkdir()
    (folder / "step-2.partial" / "state.pt").write_bytes(b"being written")
    (folder / "step-3.partial").mkdir()  # its writer died 20 minutes ago
    old = time.time() - 1200
    os.utime(folder / "step-3.partial", (old, old))
    ck.save(4, {"step": 4}, {})
    ck.wait()
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-2.partial", "step-4"]


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    ck = _saver(tmp_path, keep_last=1)
    ck.save(5, {"step": 5, "v": 1}, {})
    ck.save(5, {"step": 5, "v": 2}, {})
    ck.wait()
    assert ck.newest_loadable(0)[1]["v"] == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-5"]


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


def test_a_rank_whose_write_failed_leaves_no_partial_even_if_another_wrote_after(
        tmp_path, monkeypatch):
    """Two ranks, one run directory: rank 1's write fails (a full disk) and removes the
    partial checkpoint; rank 0 writes its file only then, creating the folder again.
    Both raise the write error, and no partial checkpoint is left to fill the disk."""
    import errno
    import threading

    import torch

    from train.checkpoint import CheckpointWriteError
    from train.checkpoint import store as store_module
    from train.core.run import rundir
    exchange, values = threading.Barrier(2, timeout=60), [None, None]

    def gather_for(rank):
        def gather(value):
            values[rank] = value
            exchange.wait()
            out = list(values)
            exchange.wait()
            return out
        return gather

    removed = threading.Event()  # rank 1 removed the partial checkpoint
    real_save = store_module.save_object

    def save_object(storage, name, obj):
        if name.endswith(rundir.rank_file(1)):
            raise OSError(errno.ENOSPC, "No space left on device")
        assert removed.wait(60)
        return real_save(storage, name, obj)

    monkeypatch.setattr(store_module, "save_object", save_object)
    ranks = [Checkpointer(tmp_path, rank=r, keep_last=2, world_size=2,
                          gather=gather_for(r)) for r in range(2)]
    real_delete = ranks[1].storage.delete
    ranks[1].storage.delete = lambda name: (real_delete(name), removed.set())
    errors: list[BaseException] = []

    def save(ck):
        try:
            ck.save(2, {"w": torch.zeros(4)}, {"rng": 1})
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(ck,)) for ck in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(errors) == 2 and all(isinstance(e, CheckpointWriteError) for e in errors), errors
    assert all(f"{rundir.rank_file(1)}: no space left on " in str(e) for e in errors), errors
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [], \
        "a partial checkpoint was left on the full disk"


def test_numpys_stream_is_kept_once_code_uses_it_and_never_imported_for_a_save():
    """A seeded numpy stream resumes where it was; one nobody imported (so nobody
    seeded) is not imported by a save, which it would cost some 50 ms."""
    code = textwrap.dedent("""
        import sys
        from train.checkpoint.state import rng_state, set_rng_state
        state = rng_state()
        assert "numpy.random" not in sys.modules and "numpy" not in state
        set_rng_state(state)
        import numpy as np
        np.random.seed(3)
        np.random.rand(5)
        saved = rng_state()
        expected = np.random.rand(4)
        np.random.rand(7)
        set_rng_state(saved)
        assert (np.random.rand(4) == expected).all()
        """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=limit(120))
    assert out.returncode == 0, out.stderr[-2000:]
