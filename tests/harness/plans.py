"""Made-up machines for the launch plan's golden tests and for GPU detection: plan() is
pure, so a machine is a Hardware/TorchBuild record and an environment mapping; the
pieces every golden plan shares (the interpreter, the app root, torchrun's argv, the
environment the launcher sets); a fake sysfs + /dev tree of AMD GPUs."""

from __future__ import annotations

from pathlib import Path

import yaml

from launcher.detection.hardware import Gpu, Hardware, TorchBuild
from launcher.planning import environ
from launcher.planning.plan import plan
from train.core.config import load_config

PY = "/opt/venv/bin/python"
APP = "/app"
CPU_HW = Hardware(cpus=8)
CPU_TORCH = TorchBuild(version="2.13.0+cpu", gloo=True)
CUDA_TORCH = TorchBuild(version="2.13.0+cu130", cuda="13.0", nccl=True, gloo=True,
                        arch_list=("sm_80", "sm_90"))
ROCM_TORCH = TorchBuild(version="2.13.0+rocm7.2", hip="7.2", nccl=True, gloo=True,
                        arch_list=("gfx90a", "gfx942"))


def gpus(n: int, vendor: str = "nvidia", arch: str = "sm_90") -> Hardware:
    return Hardware(vendor=vendor, source="test", listed=n, cpus=32,
                    driver_version="580.65.06" if vendor == "nvidia" else None,
                    cuda_driver_version="13.0" if vendor == "nvidia" else None,
                    gpus=tuple(Gpu(index=i, name="G", arch=arch) for i in range(n)))


def plan_config(folder: Path, **tree) -> str:
    """A small config file (an MLP on synthetic data) in ``folder``, with ``tree``'s
    sections merged in; its path, as the launcher is given it."""
    base = {"model": {"kind": "mlp", "depth": 1, "width": 8},
            "data": {"kind": "synthetic", "num_samples": 64, "shape": [4]},
            "train": {"global_batch_size": 48, "max_steps": 5},
            "output": {"dir": "/runs"}}
    for key, value in tree.items():
        base.setdefault(key, {}).update(value)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(base))
    return str(path)


def make(cfg_path: str, overrides=(), hw=CPU_HW, tb=CPU_TORCH, env=None):
    cfg = load_config(cfg_path, list(overrides))
    return plan(cfg, hw, tb, environ.read({"PATH": "/usr/bin", **(env or {})}),
                config_path=cfg_path, overrides=list(overrides), python=PY, app_root=APP,
                master_port=29511)


BASE_ENV = {"PYTHONPATH": APP, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": "/runs/job/nccl-flight-recorder-rank-",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/job/nccl-flight-recorder-rank-",
            "NCCL_DEBUG": "WARN"}


# torchrun's SIGTERM-to-SIGKILL wait: distributed.grace_period_s (120) - 5
SHUTDOWN = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "115"}
# A run on one node: gloo and NCCL's bootstrap on the loopback interface only.
LOOPBACK_ENV = {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
STANDALONE = ("--standalone", "--nnodes", "1", "--local-addr", "127.0.0.1")


def torchrun(*rdzv: str, nproc: int, restarts: int = 3) -> list[str]:
    return [PY, "-m", "launcher.torchrun", *rdzv, "--nproc-per-node", str(nproc),
            "--max-restarts", str(restarts), "--log-dir", "/runs/job/logs", "--tee", "3",
            "-m", "train.worker"]


def kfd_tree(root: Path, nodes: dict[int, tuple[int, int, int]], present: list[int],
             kfd: bool = True) -> Path:
    """nodes: KFD node -> (gpu_id, render minor, gfx_target_version); node 0 is a CPU."""
    base = root / "sys/class/kfd/kfd/topology/nodes"
    (base / "0").mkdir(parents=True)
    (base / "0" / "gpu_id").write_text("0\n")
    (base / "0" / "properties").write_text("cpu_cores_count 64\nsimd_count 0\n")
    for node, (gpu_id, minor, gfx) in nodes.items():
        d = base / str(node)
        d.mkdir()
        (d / "gpu_id").write_text(f"{gpu_id}\n")
        (d / "properties").write_text(f"simd_count 440\ndrm_render_minor {minor}\n"
                                      f"gfx_target_version {gfx}\nunique_id {0xabc0 + node}\n")
    (root / "dev/dri").mkdir(parents=True)
    if kfd:
        (root / "dev/kfd").touch()
    for minor in present:
        (root / f"dev/dri/renderD{minor}").touch()
    return root
