"""The launch plan of replica groups (``distributed.fault_tolerance: replicas``): the
groups and spares, the Lighthouse, each group's torchrun with its own rendezvous, the
logical world (replicas x nproc) for the batch split, one machine (or SLURM:
tests/unit/test_replica_slurm_plan.py), and torchft's
absence as a prepare stage (exit 3 naming the install). Made-up machines, as in
tests/unit/test_runner.py; the groups running for real: tests/e2e/test_replica_launch.py.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from launcher.commands import doctor
from launcher.detection import torchft_tools
from launcher.detection.hardware import Gpu, Hardware, TorchBuild
from launcher.planning import environ
from launcher.planning.replica_plan import fill
from launcher.running import runner
from train.core.errors import UserError
from train.core.run.replica_contract import (
    ADDR_VAR,
    DEVICE_OFFSET_VAR,
    GROUP_VAR,
    GROUPS_VAR,
    LIGHTHOUSE_VAR,
)

CPU_TORCH = TorchBuild(version="2.13.0+cpu", gloo=True)
CUDA_TORCH = TorchBuild(version="2.13.0+cu130", cuda="13.0", nccl=True, gloo=True,
                        arch_list=("sm_90",))


def gpus(n: int) -> Hardware:
    return Hardware(vendor="nvidia", source="test", listed=n, cpus=32,
                    driver_version="580.65.06", cuda_driver_version="13.0",
                    gpus=tuple(Gpu(index=i, name="G", arch="sm_90") for i in range(n)))
LIGHTHOUSE = "/opt/venv/bin/torchft_lighthouse"
REPLICAS = ("distributed.fault_tolerance=replicas",)


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"kind": "mlp", "depth": 1, "width": 8},
        "data": {"kind": "synthetic", "num_samples": 64, "shape": [4]},
        "train": {"global_batch_size": 48, "max_steps": 5},
        "output": {"dir": str(tmp_path / "runs")}}))
    return str(path)


@pytest.fixture
def torchft_here(monkeypatch):
    """torchft and its Lighthouse found, whatever this machine has."""
    monkeypatch.setattr(torchft_tools, "lighthouse_binary", lambda *a, **k: LIGHTHOUSE)
    monkeypatch.setattr(torchft_tools, "torchft_found", lambda: True)


def prepare(command: str, config: str, *overrides: str, env: dict | None = None,
            dry_run: bool = False, hardware: Hardware | None = None,
            tb: TorchBuild = CPU_TORCH) -> runner.Prepared | UserError:
    request = runner.Request(command, config, overrides=(*REPLICAS, *overrides),
                             dry_run=dry_run)
    try:
        return runner.prepare(request, environ.read({"PATH": "/usr/bin", **(env or {})}),
                              hardware=hardware or Hardware(cpus=8), tb=tb,
                              master_port=29511)
    except UserError as exc:
        return exc


def test_two_replicas_and_a_spare_are_three_torchruns_after_a_lighthouse(config, torchft_here):
    p = prepare("train", config, "distributed.replicas=2", "distributed.spares=1",
                "distributed.max_restarts=2")
    groups = p.plan.replica_groups
    assert (groups.replicas, groups.spares, groups.groups) == (2, 1, 3)
    # one process per group still runs torchrun: it restarts the group's worker
    assert p.plan.mode == "torchrun" and p.plan.world_sizes == (2,)
    assert groups.lighthouse[:3] == (LIGHTHOUSE, "--bind", "127.0.0.1:${LIGHTHOUSE_PORT}")
    for g, (argv, env) in enumerate(zip(groups.argvs, groups.envs, strict=True)):
        assert env == {GROUP_VAR: str(g), GROUPS_VAR: "3", ADDR_VAR: "127.0.0.1",
                       LIGHTHOUSE_VAR: "http://127.0.0.1:${LIGHTHOUSE_PORT}"}
        text = " ".join(argv)
        assert "-m launcher.torchrun --rdzv-backend c10d --rdzv-endpoint " \
               f"127.0.0.1:${{RDZV_PORT}} --rdzv-id replica-group-{g} --nnodes 1 " \
               f"--local-addr 127.0.0.1 --role group{g}-rank --nproc-per-node 1 " \
               "--max-restarts 2" in text
        assert "--standalone" not in argv and argv[-2:] == ("device=cpu",
                                                            "distributed.backend=gloo")
    # the threads are shared by every group's processes: 8 CPUs, 3 processes
    assert p.plan.env["OMP_NUM_THREADS"] == "2"
    assert fill(groups.argvs[1], RDZV_PORT=4242)[groups.argvs[1].index(
        "127.0.0.1:${RDZV_PORT}")] == "127.0.0.1:4242"


def test_dry_run_and_doctor_show_groups_spares_lighthouse_and_commands(config, torchft_here):
    p = prepare("train", config, "distributed.spares=1", dry_run=True)
    text = p.plan.render()
    assert "# replica groups: 2 + 1 spare(s) = 3 torchrun(s)" in text
    assert "# Lighthouse at http://127.0.0.1:${LIGHTHOUSE_PORT}" in text
    assert f'{LIGHTHOUSE} --bind "127.0.0.1:${{LIGHTHOUSE_PORT}}" --min_replicas 1' in text
    assert "# group 0 (replica)" in text and "# group 2 (spare)" in text
    assert "REPLICA_GROUP_ID=2 \\" in text and text.endswith("\nwait")
    assert text.count("--rdzv-endpoint \"127.0.0.1:${RDZV_PORT}\"") == 3
    d = prepare("doctor", config, "distributed.spares=1")
    report = d.plan.to_dict()
    assert report["replica_groups"]["spares"] == 1 and len(report["replica_groups"]["argvs"]) == 3
    lines = doctor._plan_lines(report)
    assert lines[1].startswith("replicas   2 group(s) + 1 spare(s), one torchrun each")
    assert lines[4].startswith("group 2    spare: REPLICA_GROUP_ID=2 NUM_REPLICA_GROUPS=3")
    assert any(f.topic == "fault tolerance" and f.level == "ok" for f in d.findings)


def test_the_batch_splits_over_every_groups_processes(config, torchft_here):
    # 2 groups x 3 processes: a logical world of 6, which 48 divides and 40 does not
    ok = prepare("train", config, "distributed.nproc_per_node=3")
    assert ok.plan.world_sizes == (6,)
    bad = prepare("train", config, "distributed.nproc_per_node=3",
                  "train.global_batch_size=40")
    assert isinstance(bad, UserError) and bad.exit_code == 2
    assert "40 is not divisible by world size 6" in bad.one_line()
    five = prepare("train", config, "distributed.replicas=5")
    assert isinstance(five, UserError) and five.exit_code == 2
    assert "world size 5" in five.one_line()


def test_several_nodes_outside_slurm_are_exit_3(config, torchft_here):
    env = {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "n0",
           "PET_MASTER_PORT": "29500"}
    for command in ("train", "doctor"):
        p = prepare(command, config, env=env)
        line = p.one_line() if isinstance(p, UserError) else \
            "error: " + next(f.message for f in p.findings if f.level == "fail")
        assert p.exit_code == 3
        assert "on one machine, on SLURM (one task per node) or in an Indexed Job" in line
        assert "distributed.fault_tolerance=restart" in line and "\n" not in line


@pytest.mark.parametrize("missing", ["binary", "package"])
def test_without_torchft_it_is_exit_3_naming_the_install(config, monkeypatch, missing):
    monkeypatch.setattr(torchft_tools, "lighthouse_binary",
                        lambda *a, **k: None if missing == "binary" else LIGHTHOUSE)
    monkeypatch.setattr(torchft_tools, "torchft_found", lambda: missing != "package")
    train = prepare("train", config)
    assert isinstance(train, UserError) and train.exit_code == 3
    line = train.one_line()
    assert "\n" not in line and "pip install 'trainpod[ft]'" in line and "make ft" in line
    assert ("torchft_lighthouse" if missing == "binary" else "torchft package") in line
    d = prepare("doctor", config)  # a finding of doctor's too
    (fail,) = [f for f in d.findings if f.level == "fail"]
    assert fail.topic == "fault tolerance" and d.exit_code == 3
    # the default (restart) never asks for torchft
    plain = runner.prepare(runner.Request("train", config), environ.read({"PATH": "/usr/bin"}),
                           hardware=Hardware(cpus=8), tb=CPU_TORCH, master_port=29511)
    assert plain.plan.replica_groups is None
    assert not [f for f in plain.findings if f.topic == "fault tolerance"]


def test_the_lighthouse_is_found_beside_the_interpreter_else_on_path(tmp_path):
    venv, other = tmp_path / "venv" / "bin", tmp_path / "elsewhere"
    venv.mkdir(parents=True)
    other.mkdir()
    assert torchft_tools.lighthouse_binary(str(venv / "python"), path=str(other)) is None
    on_path = other / "torchft_lighthouse"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(on_path.stat().st_mode | stat.S_IXUSR)
    assert torchft_tools.lighthouse_binary(str(venv / "python"), path=str(other)) == \
        str(on_path)
    beside = venv / "torchft_lighthouse"
    beside.write_text("#!/bin/sh\n")
    beside.chmod(beside.stat().st_mode | stat.S_IXUSR)
    assert torchft_tools.lighthouse_binary(str(venv / "python"), path=str(other)) == \
        str(beside)


@pytest.mark.parametrize(("groups", "nproc", "share"), [
    (("distributed.replicas=2",), (), 4),                            # auto: 8 GPUs / 2
    (("distributed.replicas=2", "distributed.spares=1"), (), 2),     # 8 // 3, two idle
    (("distributed.replicas=2",), ("distributed.nproc_per_node=3",), 3),
])
def test_on_gpus_the_groups_split_the_devices_never_sharing_one(config, torchft_here, groups,
                                                                 nproc, share):
    p = prepare("train", config, *groups, *nproc, "train.global_batch_size=48",
                hardware=gpus(8), tb=CUDA_TORCH)
    assert not isinstance(p, UserError), p
    q = p.plan.replica_groups
    assert p.plan.nproc_per_node == share
    offsets = [int(env[DEVICE_OFFSET_VAR]) for env in q.envs]
    assert offsets == [g * share for g in range(q.groups)]
    devices = [o + r for o in offsets for r in range(share)]
    assert len(set(devices)) == len(devices) and max(devices) < 8


@pytest.mark.parametrize(("overrides", "need"), [
    (("distributed.replicas=2", "distributed.spares=1"), 3),         # 3 groups, 2 GPUs
    (("distributed.replicas=2", "distributed.nproc_per_node=2"), 4),  # 4 processes
])
def test_more_groups_than_gpus_is_exit_3_naming_the_count(config, torchft_here, overrides,
                                                          need):
    p = prepare("train", config, *overrides, hardware=gpus(2), tb=CUDA_TORCH)
    assert isinstance(p, UserError) and p.exit_code == 3, p
    assert f"need {need} GPUs, one each; 2 usable here" in p.one_line()


def test_on_the_cpu_no_group_gets_a_device_offset(config, torchft_here):
    p = prepare("train", config, "distributed.replicas=2")
    assert all(DEVICE_OFFSET_VAR not in env for env in p.plan.replica_groups.envs)
