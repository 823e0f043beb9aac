"""On a real GPU: detection agrees with torch, training resumes bitwise, the memory
probe picks a micro-batch. Skipped without a usable GPU; scripts/gpu-check runs them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.harness.runs import (
    ROOT,
    TINY_GPT,
    clean_env,
    limit,
    losses,
    merge,
    run_train,
    usable_gpus,
    write_config,
)

pytestmark = pytest.mark.gpu


def test_detection_agrees_with_torch_and_plans_nccl(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "entrypoint.py"), "doctor", "--json"],
                         cwd=tmp_path, env=clean_env(gpu=True), capture_output=True, text=True,
                         timeout=limit(120))
    report = json.loads(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    hw, plan = report["hardware"], report["plan"]
    assert len(hw["gpus"]) == usable_gpus() and hw["vendor"] in ("nvidia", "amd")
    assert all(g["name"] and g["memory_bytes"] for g in hw["gpus"])
    assert (plan["device"], plan["backend"]) == ("gpu", "nccl")
    assert plan["nproc_per_node"] == len(hw["gpus"])


def test_resume_on_gpu_equals_uninterrupted_bitwise(tmp_path):
    """Deterministic kernels, dropout on: CUDA RNG state and optimizer state restored."""
    tree = merge(TINY_GPT, {"output": {"dir": str(tmp_path)}, "device": "gpu",
                            "deterministic": True, "model": {"dropout": 0.1},
                            "train": {"max_steps": 12},
                            "checkpoint": {"every_steps": 6, "keep_last": 5}})
    config = write_config(tmp_path / "g.yaml", tree)
    ref = run_train(config, gpu=True)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "device cuda" in ref.stderr
    again = tmp_path / "again"
    shutil.copytree(tmp_path / "g", again / "g")
    shutil.rmtree(again / "g" / "checkpoints" / "step-12")
    (again / "g" / "checkpoints" / "latest").write_text("step-6\n")
    resumed = run_train(config, f"output.dir={again}", gpu=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 6" in resumed.stderr
    assert losses(again / "g") == losses(tmp_path / "g")


def test_auto_micro_batch_probes_gpu_memory(tmp_path):
    tree = merge(TINY_GPT, {"output": {"dir": str(tmp_path)}, "device": "gpu",
                            "precision": "bf16",
                            "train": {"max_steps": 4, "global_batch_size": 64,
                                      "micro_batch_size": "auto"}})
    proc = run_train(write_config(tmp_path / "a.yaml", tree), gpu=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train.micro_batch_size=auto: 64 fits" in proc.stderr  # a tiny model fits whole


def test_the_straggler_clock_times_gpu_work_with_cuda_events():
    """The forward pass on a GPU is timed on the device (CUDA events): a bigger matmul
    takes longer there, whatever Python's clock saw when it returned."""
    import torch

    from train.observe.stragglers import StepPhases
    phases = StepPhases(torch.device("cuda"))
    x = torch.randn(4096, 4096, device="cuda")
    taken = []
    for repeats in (1, 20):
        def matmuls(x, repeats):
            for _ in range(repeats):
                x = (x @ x) / 4096
            return x
        x = phases.forward(matmuls, x, repeats)
        taken.append(phases.take()[1])
    assert 0 < taken[0] < taken[1], taken
