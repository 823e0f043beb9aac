"""Can this torch build drive these GPUs? The compatibility policy, as pure functions.

Used by the launch plan (a failure is exit 3) and by ``doctor``. Inputs are the plain
records of :mod:`launcher.detection.hardware`; nothing here runs a tool or imports torch.

- NVIDIA: the driver must support the CUDA major the wheel was built with (CUDA's
  minor-version compatibility covers a newer minor, with a warning: PTX JIT may fail),
  and the GPU's compute capability must be in the build's arch list (a cubin for
  sm_XY runs on the same major with an equal or higher minor; PTX for compute_XY is
  JIT-compiled for any newer GPU). CUDA 13 builds start at sm_75.
- AMD: the GPU's gfx target must be in the build's list, unless
  ``HSA_OVERRIDE_GFX_VERSION`` asks the runtime to treat it as another one.
- A GPU of one vendor with the other vendor's build (or a CPU build) cannot work.
"""

from __future__ import annotations

import re

from launcher.detection.hardware import Finding, Hardware, TorchBuild

# Oldest driver branch for each CUDA major (CUDA's minor-version compatibility).
DRIVER_FOR_CUDA = {11: "R450", 12: "R525", 13: "R580"}


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
                        install_fix(), 3)]
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
    forward = forward_compatibility(hw) if need and have and have[0] < need[0] else None
    if forward:
        out.append(Finding(
            "warn", "driver", f"the NVIDIA driver {hw.driver_version} supports CUDA up to "
            f"{hw.cuda_driver_version}, older than torch's CUDA {tb.cuda}: runs through CUDA "
            f"forward compatibility ({forward}; {hw.cuda_compat})", "needs NVIDIA Container "
            "Toolkit 1.17.5 or newer, whose enable-cuda-compat hook puts the image's "
            "compatibility libraries first (or LD_LIBRARY_PATH=/usr/local/cuda/compat); if "
            "CUDA does not initialise, update the "
            f"host driver to {DRIVER_FOR_CUDA.get(need[0], 'a newer one')}"))
    elif need and have and have[0] < need[0]:
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


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


def _clause_admits(clause: str, brand: str, driver: tuple[int, ...]) -> bool:
    """One NVIDIA_REQUIRE_CUDA clause (comma-separated conditions, all must hold) of the
    brand/driver kind: ``brand=tesla,driver>=535,driver<536``."""
    conditions = clause.split(",")
    if not any(c.startswith("brand=") for c in conditions):
        return False  # the plain cuda>=X clause: the driver itself must be new enough
    for cond in conditions:
        m = re.fullmatch(r"(brand|driver)(>=|<=|=|<|>)(.+)", cond)
        if not m:
            return False
        key, op, value = m.groups()
        if key == "brand":
            if op != "=" or value.lower() != brand:
                return False
            continue
        want = _version_tuple(value)
        have = driver[:len(want)]
        if not {">=": have >= want, "<=": have <= want, "=": have == want,
                "<": have < want, ">": have > want}[op]:
            return False
    return True


def forward_compatibility(hw: Hardware) -> str | None:
    """Why an image built for a newer CUDA runs on this older driver, or None.

    NVIDIA's CUDA base images ship the newer driver's user-space part
    (``/usr/local/cuda/compat``) and list, in ``NVIDIA_REQUIRE_CUDA``, the data center
    brands and driver branches it supports on (space-separated clauses, any may hold;
    comma-separated conditions, all must). Both must be here, and every GPU must match
    a clause: https://docs.nvidia.com/deploy/cuda-compatibility/forward-compatibility.html
    """
    if not (hw.cuda_compat and hw.cuda_requirement and hw.driver_version and hw.gpus):
        return None
    driver = _version_tuple(hw.driver_version)
    for gpu in hw.gpus:
        if not gpu.brand or not any(_clause_admits(c, gpu.brand, driver)
                                    for c in hw.cuda_requirement.split()):
            return None
    brands = ", ".join(sorted({g.brand for g in hw.gpus}))
    return f"{brands} GPU(s), driver branch R{driver[0]} listed by the image's NVIDIA_REQUIRE_CUDA"


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


def install_fix(app_root: str | None = None, python: str | None = None) -> str:
    """What to do when this interpreter lacks torch (or another dependency).

    In the image the environment is baked in, so the image is broken. In a checkout the
    dependencies live in the checkout's ``.venv`` (``make venv``), and the usual mistake
    is running a command with the system ``python`` instead of that one. Installed with
    pip (the ``trainpod`` command), torch is the user's to add: its build depends on the
    machine.
    """
    import os
    import sys
    python = python or sys.executable
    root = os.path.abspath(app_root or os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    venv_python = os.path.join(root, ".venv", "bin", "python")
    in_checkout = os.path.exists(os.path.join(root, "Makefile"))
    if os.path.basename(root) in ("site-packages", "dist-packages"):
        return (f"install the torch build for this machine into that environment, e.g. "
                f"`{python} -m pip install torch --index-url "
                "https://download.pytorch.org/whl/cpu` (or .../whl/cu130, cu126, rocm7.2; "
                "plain PyPI's Linux torch is the CUDA 13.0 build); for another missing "
                "package reinstall trainpod")
    if not in_checkout:
        return "rebuild the image (its Python environment is incomplete)"
    inside = os.path.abspath(os.getcwd()) == root
    venv = ".venv" if inside else os.path.join(root, ".venv")
    entry = "entrypoint.py" if inside else os.path.join(root, "entrypoint.py")
    # a venv's python is often a link to the system one: compare environments, not files
    in_venv = os.path.realpath(sys.prefix) == os.path.realpath(os.path.join(root, ".venv"))
    if os.path.exists(venv_python) and not in_venv:
        return (f"{python} is not this checkout's environment: run `{venv}/bin/python "
                f"{entry} ...`, or `. {venv}/bin/activate` once per shell")
    if not os.path.exists(venv_python):
        return f"this checkout has no .venv yet: run `make venv` in {root}, then " \
               f"`. {venv}/bin/activate`"
    return "this checkout's .venv is incomplete: run `make venv` again (or `make clean venv`)"
