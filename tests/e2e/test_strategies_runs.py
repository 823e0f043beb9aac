"""Parallel strategies and memory savers on CPU with real processes (gloo): FSDP on two
processes against one and resumed, activation checkpointing, torch.compile. What this
machine cannot run: tests/unit/test_strategies.py."""

from __future__ import annotations

import math

import pytest

from tests.harness.runs import losses, merge, run_train, strategy_config, write_config


def _assert_close(a: dict, b: dict, rel: float = 1e-5) -> None:
    assert sorted(a) == sorted(b)
    for step in a:
        assert math.isclose(a[step], b[step], rel_tol=rel), (step, a[step], b[step])


def test_fsdp_on_two_processes_matches_one_process_and_resumes(tmp_path):
    config = strategy_config(tmp_path)
    assert run_train(config, "run.name=one").returncode == 0
    single = run_train(config, "run.name=fsdp1", "distributed.strategy=fsdp")  # a group of one
    assert single.returncode == 0, single.stderr[-3000:]
    _assert_close(losses(tmp_path / "one"), losses(tmp_path / "fsdp1"))
    proc = run_train(config, "run.name=fsdp", "distributed.strategy=fsdp", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_close(losses(tmp_path / "one"), losses(tmp_path / "fsdp"))
    accum = run_train(config, "run.name=fsdp_accum", "distributed.strategy=fsdp",
                      "train.micro_batch_size=2", "memory.activation_checkpointing=full",
                      nproc=2)  # 2 micro-steps, one gradient sync; FSDP over recomputed blocks
    assert accum.returncode == 0, accum.stderr[-3000:]
    _assert_close(losses(tmp_path / "one"), losses(tmp_path / "fsdp_accum"))
    # Resume the FSDP run from its step-4 checkpoint (full tensors, loaded by broadcast).
    ckpts = tmp_path / "fsdp" / "checkpoints"
    (ckpts / "latest").write_text("step-4\n")
    for later in ckpts.glob("step-8"):
        import shutil
        shutil.rmtree(later)
    proc = run_train(config, "run.name=fsdp", "distributed.strategy=fsdp", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 4" in proc.stderr
    _assert_close(losses(tmp_path / "one"), losses(tmp_path / "fsdp"))


@pytest.mark.parametrize("mode", ["full", "every_n"])
def test_activation_checkpointing_does_not_change_the_math(tmp_path, mode):
    config = strategy_config(tmp_path, model={"depth": 2})
    assert run_train(config, "run.name=plain").returncode == 0
    proc = run_train(config, "run.name=ac", f"memory.activation_checkpointing={mode}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "activation checkpointing on" in proc.stderr
    _assert_close(losses(tmp_path / "plain"), losses(tmp_path / "ac"), rel=1e-6)


def test_compiled_model_matches_eager_and_its_checkpoint_loads_without_compile(tmp_path):
    from tests.harness.runs import TINY_MLP
    tree = merge(TINY_MLP, {"output": {"dir": str(tmp_path)}, "train": {"max_steps": 5}})
    config = write_config(tmp_path / "m.yaml", tree)
    assert run_train(config, "run.name=eager").returncode == 0
    proc = run_train(config, "run.name=compiled", "compile=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # said as the model is wrapped, before step 1 waits for the compile
    assert "compile: the model is compiled in its first steps" in proc.stderr
    _assert_close(losses(tmp_path / "eager"), losses(tmp_path / "compiled"), rel=1e-4)
    resumed = run_train(config, "run.name=compiled", "train.max_steps=7")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 5" in resumed.stderr
