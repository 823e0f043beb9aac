"""RDMA as NCCL/RCCL will find it: sysfs devices and ports, the container's device
files, the verbs library; doctor says which transport multi-node NCCL gets and why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launcher.detection import rdma
from tests.harness.runs import ROOT, clean_env, limit


def fabric(root: Path, ports: dict[str, tuple[str, str]], device_files: bool = True) -> str:
    """A host's /sys/class/infiniband (as the kernel lays it out) and /dev/infiniband."""
    for name, (state, layer) in ports.items():
        port = root / "sys/class/infiniband" / name / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(f"{state}\n")
        (port / "link_layer").write_text(f"{layer}\n")
        (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    if device_files:
        (root / "dev/infiniband").mkdir(parents=True)
        for i in range(len(ports)):
            (root / "dev/infiniband" / f"uverbs{i}").touch()
    return str(root)


def test_active_port_device_files_and_library_mean_ib(tmp_path):
    root = fabric(tmp_path, {"mlx5_0": ("4: ACTIVE", "InfiniBand"),
                             "mlx5_1": ("1: DOWN", "Ethernet")})
    info = rdma.detect(root, {}, verbs=lambda: True)
    assert info["active"] == ["mlx5_0"] and info["nccl_transport"] == "IB"
    assert info["device_files"] == ["uverbs0", "uverbs1"]
    assert [f.level for f in rdma.findings(info, multi_node_gpu=True)] == ["ok"]
    assert "mlx5_0/1 ACTIVE InfiniBand 200 Gb/sec" in rdma.line(info)


@pytest.mark.parametrize("case, words", [
    ("no library", "libibverbs.so.1 is not in this image"),
    ("no device files", "--device=/dev/infiniband"),
    ("no active port", "no ACTIVE port"),
])
def test_each_missing_piece_is_a_warning_that_says_sockets(tmp_path, case, words):
    state = "1: DOWN" if case == "no active port" else "4: ACTIVE"
    root = fabric(tmp_path, {"mlx5_0": (state, "Ethernet")},
                  device_files=case != "no device files")
    info = rdma.detect(root, {}, verbs=lambda: case != "no library")
    assert info["nccl_transport"] == "Socket"
    (finding,) = rdma.findings(info, multi_node_gpu=True)
    assert finding.level == "warn" and "TCP sockets" in finding.message
    assert words in finding.message + (finding.fix or "")
    assert rdma.findings(info, multi_node_gpu=False) == []  # one node, or gloo: irrelevant


@pytest.mark.parametrize("env", [{"NCCL_IB_DISABLE": "1"}, {"NCCL_NET": "Socket"}])
def test_sockets_chosen_on_purpose_are_not_a_warning(tmp_path, env):
    root = fabric(tmp_path, {"mlx5_0": ("4: ACTIVE", "InfiniBand")})
    info = rdma.detect(root, env, verbs=lambda: True)
    assert info["nccl_transport"] == "Socket" and info["disabled_by_env"]
    assert rdma.findings(info, multi_node_gpu=True) == []


def test_the_real_loader_is_asked_and_nothing_without_devices(tmp_path):
    assert isinstance(rdma.verbs_loadable(), bool)
    info = rdma.detect(str(tmp_path), {})
    assert info["devices"] == [] and info["verbs_library"] is None
    assert info["nccl_transport"] == "Socket"


def test_doctor_reports_the_fabric(tmp_path):
    root = fabric(tmp_path / "host", {"mlx5_0": ("4: ACTIVE", "Ethernet")})
    out = subprocess.run([sys.executable, str(ROOT / "entrypoint.py"), "doctor"], cwd=tmp_path,
                         env=clean_env(TRAIN_HW_ROOT=root), capture_output=True, text=True,
                         timeout=limit(120))
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("rdma"))
    assert "mlx5_0/1 ACTIVE Ethernet" in line and "uverbs0" in line
    verbs = "found" if rdma.verbs_loadable() else "missing"
    assert f"libibverbs.so.1: {verbs}" in line
