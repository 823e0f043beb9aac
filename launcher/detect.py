"""What this machine has and what the installed torch can drive, without touching CUDA.

``detect()`` asks NVML, then amd-smi/rocm-smi + sysfs, else reports CPU only; missing
tools and libraries are normal. ``torch_build()`` imports torch (lazily, never at
module import) but reads only compile-time facts: ``torch.version.cuda/hip``, the
compiled arch list and which process-group backends exist. ``check_build()`` says
whether that build can use the GPUs found (driver new enough, arch compiled in,
vendor right): the findings behind exit code 3.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from launcher import amd, nvidia
from launcher.environ import Environ
from launcher.hardware import Finding, Hardware, TorchBuild

# Oldest driver branch for each CUDA major (CUDA's minor-version compatibility).
DRIVER_FOR_CUDA = {11: "R450", 12: "R525", 13: "R580"}


def available_cpus(root: str = "/") -> int:
    """CPUs this process may use: affinity mask, capped by the cgroup CPU quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        quota = (Path(root) / "sys/fs/cgroup/cpu.max").read_text().split()
        if quota and quota[0] != "max":
            cpus = min(cpus or 1, max(1, math.ceil(int(quota[0]) / int(quota[1]))))
    except (OSError, ValueError, IndexError):
        pass
    return max(1, cpus or 1)


def detect(env: Environ, nvml: Any | None = None, load_nvml: bool = True) -> Hardware:
    """GPUs this process can use (NVIDIA first, then AMD), else CPU only."""
    cpus = available_cpus(env.hw_root)
    nv = nvidia.detect(env.visibility, nvml=nvml, root=env.hw_root, load=load_nvml,
                       path=env.path)
    if nv is not None and nv.vendor:
        return _with(nv, cpus=cpus)
    am = amd.detect(env.visibility, env.path, root=env.hw_root)
    notes = nv.notes if nv else ()
    warnings = nv.warnings if nv else ()
    if am is not None and am.vendor:
        return _with(am, cpus=cpus, notes=notes + am.notes, warnings=warnings + am.warnings)
    return Hardware(cpus=cpus, notes=notes, warnings=warnings)


def _with(hw: Hardware, **changes: Any) -> Hardware:
    from dataclasses import replace
    return replace(hw, **changes)


def torch_build() -> TorchBuild:
    """Compile-time facts of the installed torch. Never initialises CUDA or HIP."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # a broken install is reported, not raised
        return TorchBuild(importable=False, error=f"{type(exc).__name__}: {exc}")
    arch = ""
    getter = getattr(torch._C, "_cuda_getArchFlags", None)  # compile-time string, no init
    if getter is not None:
        try:
            arch = getter() or ""
        except Exception:
            arch = ""
    available = dist.is_available()
    return TorchBuild(
        version=str(torch.__version__),
        cuda=getattr(torch.version, "cuda", None),
        hip=getattr(torch.version, "hip", None),
        arch_list=tuple(a for a in re.split(r"[\s;,]+", arch) if a),
        nccl=bool(available and dist.is_nccl_available()),
        gloo=bool(available and dist.is_gloo_available()),
        mpi=bool(available and dist.is_mpi_available()))


def cuda_arch_supported(arch: str, arch_list: tuple[str, ...]) -> bool | None:
    """Can a build compiled for ``arch_list`` run on a GPU of ``arch`` (sm_XY)?

    A cubin for sm_XY runs on the same major with an equal or higher minor; PTX
    (compute_XY) is JIT-compiled for any newer GPU. None when the list is unknown.
    """
    if not arch_list or not arch.startswith("sm_"):
        return None
    cc = int(arch[3:])
    for entry in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+)([a-z]?)", entry)
        if not m:
            continue
        v, suffix = int(m[2]), m[3]
        if m[1] == "sm" and v // 10 == cc // 10 and v <= cc and (not suffix or v == cc):
            return True
        if m[1] == "compute" and v <= cc and not suffix:
            return True
    return False


def _major(version: str | None) -> tuple[int, int] | None:
    try:
        major, minor = (version or "").split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def check_build(hw: Hardware, tb: TorchBuild, hsa_override: str | None = None) -> list[Finding]:
    """Findings about driving ``hw.gpus`` with ``tb``; level fail means exit 3 on GPU."""
    if not hw.gpus:
        return []
    n = len(hw.gpus)
    if not tb.importable:
        return [Finding("fail", "torch", f"torch is not importable: {tb.error}",
                        "rebuild the image or reinstall torch", 3)]
    if hw.vendor == "nvidia" and tb.kind != "cuda":
        what = "a ROCm build" if tb.kind == "rocm" else "a CPU-only build"
        return [Finding("fail", "torch", f"torch {tb.version} is {what} and cannot use the {n} "
                        "NVIDIA GPU(s) found", "use the CUDA image (Dockerfile.cuda), or set "
                        "device=cpu to train on the CPU", 3)]
    if hw.vendor == "amd" and tb.kind != "rocm":
        what = "a CUDA build" if tb.kind == "cuda" else "a CPU-only build"
        return [Finding("fail", "torch", f"torch {tb.version} is {what} and cannot use the {n} "
                        "AMD GPU(s) found", "use the ROCm image (Dockerfile.rocm), or set "
                        "device=cpu to train on the CPU", 3)]
    if hw.vendor == "nvidia":
        return _check_cuda(hw, tb)
    return _check_rocm(hw, tb, hsa_override)


def _check_cuda(hw: Hardware, tb: TorchBuild) -> list[Finding]:
    out: list[Finding] = []
    need, have = _major(tb.cuda), _major(hw.cuda_driver_version)
    if need and have and have[0] < need[0]:
        out.append(Finding(
            "fail", "driver", f"the NVIDIA driver {hw.driver_version} supports CUDA up to "
            f"{hw.cuda_driver_version}, older than this image's torch {tb.version} (CUDA "
            f"{tb.cuda})", f"update the host driver to {DRIVER_FOR_CUDA.get(need[0], 'a newer')}"
            f" or newer, or use an image built for CUDA {have[0]}.x (e.g. the cu126 variant)", 3))
    elif need and have and have < need:
        out.append(Finding("warn", "driver", f"driver CUDA {hw.cuda_driver_version} < torch's "
                           f"CUDA {tb.cuda}: runs through minor-version compatibility; PTX JIT "
                           "may fail", "update the host driver"))
    for gpu in hw.gpus:
        if gpu.arch and cuda_arch_supported(gpu.arch, tb.arch_list) is False:
            out.append(Finding(
                "fail", "arch", f"GPU {gpu.index} ({gpu.name}) is {gpu.arch}, but torch "
                f"{tb.version} was built for {' '.join(tb.arch_list)}",
                "use an image whose torch covers this GPU (CUDA 13 builds start at sm_75; "
                "cu126 covers sm_50-sm_90)", 3))
            break
    return out


def _check_rocm(hw: Hardware, tb: TorchBuild, hsa_override: str | None) -> list[Finding]:
    if hsa_override or not tb.arch_list:
        return []
    built = {a.split(":")[0] for a in tb.arch_list}  # "gfx90a:xnack-" -> "gfx90a"
    for gpu in hw.gpus:
        if gpu.arch and gpu.arch not in built:
            return [Finding("fail", "arch", f"GPU {gpu.index} ({gpu.name}) is {gpu.arch}, but "
                            f"torch {tb.version} was built for {' '.join(tb.arch_list)}",
                            "use a ROCm image built for this GPU (HSA_OVERRIDE_GFX_VERSION "
                            "works only for a compatible ISA)", 3)]
    return []
