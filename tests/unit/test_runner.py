"""One launch pipeline: ``train``, ``train --dry-run``, ``launch`` and ``doctor`` prepared in
the same golden environments reach the same plan and the same findings.

Each environment is made up (an environment mapping, Hardware and TorchBuild records),
so nothing here depends on the host; the config and output folder are real files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launcher.detection.hardware import Gpu, Hardware, TorchBuild
from launcher.planning import environ
from launcher.running import runner
from train.core.errors import UserError

CPU_TORCH = TorchBuild(version="2.13.0+cpu", gloo=True)
CUDA_TORCH = TorchBuild(version="2.13.0+cu130", cuda="13.0", nccl=True, gloo=True,
                        arch_list=("sm_80", "sm_90"))


def gpus(n: int, vendor: str = "nvidia") -> Hardware:
    return Hardware(vendor=vendor, source="test", listed=n, cpus=32,
                    driver_version="580.65.06" if vendor == "nvidia" else None,
                    cuda_driver_version="13.0" if vendor == "nvidia" else None,
                    gpus=tuple(Gpu(index=i, name="G", arch="sm_90" if vendor == "nvidia"
                                   else "gfx90a") for i in range(n)))


INDEXED = {"JOB_COMPLETION_INDEX": "1", "TRAIN_RDZV_ENDPOINT": "rdzv:29400",
           "TRAIN_NNODES": "1:4", "TRAIN_RDZV_ID": "uid-1"}
KUBEFLOW = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2",
            "RANK": "1"}
# name: (environment, hardware, torch build, the exit code train gives, or 0)
ENVIRONMENTS = {
    "single-cpu": ({}, Hardware(cpus=8), CPU_TORCH, 0),
    "four-gpus": ({}, gpus(4), CUDA_TORCH, 0),
    "indexed-job": (INDEXED, gpus(2), CUDA_TORCH, 0),
    "kubeflow-v1": (KUBEFLOW, gpus(2), CUDA_TORCH, 0),
    "torchrun-env": ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "n0",
                      "PET_MASTER_PORT": "29500"}, Hardware(cpus=4), CPU_TORCH, 0),
    "amd-gpus-cpu-torch": ({}, gpus(1, "amd"), CPU_TORCH, 3),
    "bad-nnodes": ({**INDEXED, "TRAIN_NNODES": "2:1"}, gpus(2), CUDA_TORCH, 2),
    "no-torch": ({}, Hardware(cpus=2), TorchBuild(importable=False, error="ImportError: x"), 3),
}
DECISIONS = ("mode", "device", "backend", "nproc_per_node", "nnodes", "world_sizes",
             "max_restarts", "convention", "job", "store", "rdzv_host", "static_nodes")


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"kind": "mlp", "depth": 1, "width": 8},
        "data": {"kind": "synthetic", "num_samples": 64, "shape": [4]},
        "train": {"global_batch_size": 48, "max_steps": 5},
        "distributed": {"max_restarts": 0},
        "output": {"dir": str(tmp_path / "runs")}}))
    return str(path)


def prepared(request: runner.Request, name: str) -> runner.Prepared | UserError:
    env, hw, tb, _ = ENVIRONMENTS[name]
    try:
        return runner.prepare(request, environ.read({"PATH": "/usr/bin", **env}), hardware=hw,
                              tb=tb, master_port=29511)
    except UserError as exc:
        return exc


def decisions(p: runner.Prepared) -> dict:
    return {k: getattr(p.plan, k) for k in DECISIONS}


def shared(findings) -> list[tuple[str, str, int]]:
    """What every command must agree on (the plan's own line names the command)."""
    return [(f.level, f.topic, f.exit_code) for f in findings if f.topic != "plan" or
            f.level != "ok"]


@pytest.mark.parametrize("name", list(ENVIRONMENTS))
def test_train_dry_run_and_doctor_agree(config, name):
    expected_code = ENVIRONMENTS[name][3]
    train = prepared(runner.Request("train", config), name)
    dry = prepared(runner.Request("train", config, dry_run=True), name)
    doctor = prepared(runner.Request("doctor", config), name)
    assert isinstance(doctor, runner.Prepared)  # doctor collects, never raises
    assert doctor.exit_code == expected_code
    if expected_code:
        assert isinstance(train, UserError) and isinstance(dry, UserError)
        assert train.exit_code == dry.exit_code == expected_code
        assert train.one_line() == dry.one_line()
        first = next(f for f in doctor.findings if f.level == "fail")
        said = first.message + (f"; {first.fix}" if first.fix else "")
        assert "error: " + said == train.one_line()  # the same words, as one line
        return
    assert decisions(train) == decisions(dry) == decisions(doctor)
    assert train.plan.argv == dry.plan.argv == doctor.plan.argv
    assert train.plan.env == dry.plan.env == doctor.plan.env
    assert shared(train.findings) == shared(dry.findings) == shared(doctor.findings)
    assert {f.topic for f in doctor.findings} >= {"plan", "output", "shm"}


@pytest.mark.parametrize("name", [n for n, e in ENVIRONMENTS.items() if not e[3]])
def test_launch_plans_as_train_does(config, tmp_path, name):
    """A script under ``launch`` gets the trainer's device, backend, processes and nodes."""
    script = tmp_path / "mine.py"
    script.write_text("print('hi')\n")
    overrides = ("distributed.max_restarts=0", f"output.dir={tmp_path / 'runs'}")
    launch = prepared(runner.Request("launch", overrides=overrides, script=(str(script),)),
                      name)
    train = prepared(runner.Request("train", config), name)
    assert isinstance(launch, runner.Prepared), launch
    assert {k: v for k, v in decisions(launch).items() if k != "world_sizes"} == \
        {k: v for k, v in decisions(train).items() if k != "world_sizes"}
    assert launch.plan.program == "script" and "train.script" in launch.plan.argv
    assert shared(launch.findings) == shared(train.findings)


def test_nothing_is_written_by_doctor_or_a_dry_run(config, tmp_path):
    for request in (runner.Request("doctor", config), runner.Request("train", config,
                                                                     dry_run=True)):
        assert isinstance(prepared(request, "single-cpu"), runner.Prepared)
        assert not (tmp_path / "runs").exists()
    assert isinstance(prepared(runner.Request("train", config), "single-cpu"), runner.Prepared)
    assert (tmp_path / "runs").is_dir()  # train creates its output folder


def test_a_bad_config_is_every_commands_exit_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim: {lr: -1}\nmodel: {widht: 3}\n")
    train = prepared(runner.Request("train", str(path)), "four-gpus")
    doctor = prepared(runner.Request("doctor", str(path)), "four-gpus")
    assert isinstance(train, UserError) and train.exit_code == 2
    assert [f.message for f in doctor.findings if f.level == "fail"] == \
        [line.removeprefix("error: ") for line in train.one_line().splitlines()]
    assert doctor.plan is None and doctor.exit_code == 2


def test_a_host_name_on_loopback_is_said_before_a_multi_node_launch(config, monkeypatch):
    """gloo tells its peers the address this host's name resolves to: 127.0.1.1 there
    means connection failures across hosts, so a multi-node plan warns, naming the fix;
    a named interface, or a single node, needs no warning."""
    from launcher.detection import system
    monkeypatch.setattr(system, "loopback_name", lambda: ("box", "127.0.1.1"))
    multi = prepared(runner.Request("train", config), "indexed-job")
    (warn,) = [f for f in multi.findings if f.topic == "network"]
    assert warn.level == "warn" and "box resolves to 127.0.1.1" in warn.message
    assert "TRAIN_SOCKET_IFNAME" in warn.fix
    single = prepared(runner.Request("train", config), "single-cpu")
    assert not [f for f in single.findings if f.topic == "network"]
    env, hw, tb, _ = ENVIRONMENTS["indexed-job"]
    named = runner.prepare(runner.Request("doctor", config),
                           environ.read({"PATH": "/usr/bin", **env, "TRAIN_SOCKET_IFNAME": "eth0"}),
                           hardware=hw, tb=tb, master_port=29511)
    assert not [f for f in named.findings if f.topic == "network"]
