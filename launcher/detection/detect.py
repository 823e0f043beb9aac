"""What this machine has and what the installed torch can drive, without touching CUDA.

``detect()`` asks NVML, then amd-smi/rocm-smi + sysfs, else reports CPU only; missing
tools and libraries are normal and end up as notes. ``torch_build()`` imports torch
(lazily, never at module import) but reads only compile-time facts:
``torch.version.cuda/hip``, the compiled arch list and which process-group backends
exist. Whether that build can drive what was found is :mod:`launcher.detection.compat`'s call.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from launcher.detection import amd, nvidia
from launcher.detection.hardware import Hardware, TorchBuild
from launcher.planning.variables import Environ
from train.core.machine.host import available_cpus, available_memory


def detect(env: Environ, nvml: Any | None = None, load_nvml: bool = True) -> Hardware:
    """GPUs this process can use (NVIDIA first, then AMD), else CPU only."""
    host = {"cpus": available_cpus(env.hw_root),
            "memory_available": available_memory(env.hw_root)}
    nv = nvidia.detect(env.visibility, nvml=nvml, root=env.hw_root, load=load_nvml,
                       path=env.path)
    if nv.vendor:
        return replace(nv, **host, cuda_requirement=env.raw.get("NVIDIA_REQUIRE_CUDA") or None)
    am = amd.detect(env.visibility, env.path, root=env.hw_root)
    return replace(am, **host, notes=nv.notes + am.notes, warnings=nv.warnings + am.warnings)


def torch_build_on_disk() -> TorchBuild | None:
    """What the installed torch was built for, read from its files without importing it
    (``import torch`` is about 2 s of a launch): the version and CUDA/ROCm of its
    ``version.py``, the backends every Linux build of that kind has (gloo; nccl with CUDA
    or ROCm), no GPU architectures. None when the files do not say (then import it)."""
    try:
        spec = importlib.util.find_spec("torch")  # finds, does not import
    except (ImportError, ValueError):
        return None
    folders = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for folder in folders:
        try:
            tree = ast.parse((folder / "version.py").read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        values = {}
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) else \
                node.target if isinstance(node, ast.AnnAssign) else None
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
                values[target.id] = node.value.value
        version = values.get("__version__")
        if not isinstance(version, str) or not any(folder.glob("_C*.so")):
            return None
        cuda, hip = values.get("cuda"), values.get("hip")
        linux = sys.platform.startswith("linux")
        return TorchBuild(version=version, cuda=cuda, hip=hip, arch_list=(),
                          nccl=linux and bool(cuda or hip), gloo=linux, mpi=False)
    return None


def torch_build() -> TorchBuild:
    """Compile-time facts of the installed torch. Never initialises CUDA or HIP."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:
        # A broken install is reported, not raised, and its import fails with whatever it
        # meets (ImportError, OSError from a shared library, RuntimeError or
        # AttributeError of a mismatched build): no narrower class covers them.
        return TorchBuild(importable=False, error=f"{type(exc).__name__}: {exc}")
    arch = ""
    getter = getattr(torch._C, "_cuda_getArchFlags", None)  # compile-time string, no init
    if getter is not None:
        try:
            arch = getter() or ""
        except RuntimeError:  # torch's C++ errors
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

