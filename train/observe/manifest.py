"""manifest.json: what a run was made of, so it can be reproduced or audited.

Config hash, data hash, code version, the image's build manifest, torch / CUDA / ROCm /
driver versions, GPU names, seed, the user's own code files with their hashes (custom
models, data or losses), and one entry per (re)start with its world size.
Written by rank 0, atomically, and extended (never replaced) on restarts.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from train import __version__
from train.core.config import Config, to_yaml
from train.core.files import write_json_atomic
from train.core.machine.host import read_build_manifest
from train.core.run import rundir


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()


def code_version(explicit: str | None) -> str:
    """TRAIN_CODE_VERSION (set in images), else git describe of the source tree, else the
    package version."""
    if explicit:
        return explicit
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=5)
        if out.returncode == 0 and out.stdout.strip():
            return f"{__version__}+git.{out.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    return __version__


def software_versions() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["driver"] = _driver_version()
    return info


def _driver_version() -> str | None:
    """NVIDIA's driver version; None on AMD or without NVML (the ROCm version then
    describes the driver)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError):  # no libnvidia-ml, no driver loaded
        return None
    try:
        return pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def update_manifest(run_dir: Path, cfg: Config, *, data_hash: str, data_description: str,
                    world_size: int, start_step: int, restart_count: int,
                    build_manifest_path: str, explicit_code_version: str | None,
                    user_code: dict[str, str] | None = None) -> dict:
    path = run_dir / rundir.MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        manifest = {}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    manifest.setdefault("created", now)
    manifest.update({
        "run": cfg.run.name, "seed": cfg.seed, "config_sha256": config_hash(cfg),
        "data_sha256": data_hash, "data": data_description,
        "code_version": code_version(explicit_code_version),
        "software": software_versions(),
        "image_build_manifest": read_build_manifest(build_manifest_path),
    })
    if user_code:  # the user's own files this run imported (model.factory, data.factory...)
        manifest["user_code"] = user_code
    manifest.setdefault("starts", []).append({
        "time": now, "world_size": world_size, "start_step": start_step,
        "torchelastic_restart_count": restart_count})
    write_json_atomic(path, manifest)
    return manifest
