"""NVIDIA GPUs through NVML (``pynvml`` from nvidia-ml-py), never through CUDA.

NVML lists every GPU the container can see and ignores ``CUDA_VISIBLE_DEVICES``
(gpuopenanalytics/pynvml#28, pytorch#94472), so the list is filtered here the way
the CUDA runtime does it: entries are indices, ``GPU-<uuid>`` or ``MIG-<uuid>``
(unique prefixes allowed), and the first entry that matches nothing ends the list.
The plan sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA's numbering equals NVML's.

A missing NVML library (no driver mounted: ``docker run`` without ``--gpus``) is
normal and only produces a note. Without the pynvml package (a bare machine rather
than the image), ``nvidia-smi``'s CSV output stands in for it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.detection import visibility
from launcher.detection.hardware import Gpu, Hardware
from launcher.planning.variables import Visibility


@dataclass
class _Physical:
    index: int
    name: str
    uuid: str
    memory: int | None
    arch: str | None
    bus_id: str | None
    mig_enabled: bool = False
    migs: list[tuple[str, int | None]] = field(default_factory=list)  # (MIG uuid, memory)
    brand: str | None = None


# nvmlDeviceGetBrand's values by the names NVIDIA_REQUIRE_CUDA's brand= clauses use
# (nvml.h's nvmlBrandType_t; libnvidia-container's brand names). Data center GPUs are
# "tesla" (older) or "nvidia" (an H200 answers 14); GeForce cards never get forward
# compatibility.
BRANDS = {0: "unknown", 1: "quadro", 2: "tesla", 3: "nvs", 4: "grid", 5: "geforce",
          6: "titan", 7: "vapps", 8: "vpc", 9: "vcs", 10: "vws", 11: "cloudgaming",
          12: "quadrortx", 13: "nvidiartx", 14: "nvidia", 15: "geforcertx", 16: "titanrtx"}
# Where NVIDIA's CUDA base images put the forward-compatibility driver libraries.
CUDA_COMPAT_LIBCUDA = "usr/local/cuda/compat/libcuda.so.1"


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def load_pynvml() -> Any | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _try(nvml: Any, fn: str, *args: Any) -> Any:
    """Call an optional NVML query; None when unsupported (old driver, vGPU, MIG child)."""
    try:
        return getattr(nvml, fn)(*args)
    except (nvml.NVMLError, AttributeError):
        return None


def _physical(nvml: Any, i: int) -> _Physical:
    handle = nvml.nvmlDeviceGetHandleByIndex(i)
    mem = _try(nvml, "nvmlDeviceGetMemoryInfo", handle)
    cc = _try(nvml, "nvmlDeviceGetCudaComputeCapability", handle)
    pci = _try(nvml, "nvmlDeviceGetPciInfo", handle)
    mig_mode = _try(nvml, "nvmlDeviceGetMigMode", handle)
    brand = _try(nvml, "nvmlDeviceGetBrand", handle)
    gpu = _Physical(index=i, name=_s(nvml.nvmlDeviceGetName(handle)),
                    uuid=_s(nvml.nvmlDeviceGetUUID(handle)),
                    memory=int(mem.total) if mem is not None else None,
                    arch=f"sm_{cc[0]}{cc[1]}" if cc else None,
                    bus_id=_s(pci.busId) if pci is not None else None,
                    mig_enabled=bool(mig_mode and mig_mode[0]),
                    brand=BRANDS.get(int(brand), "unknown") if brand is not None else None)
    if gpu.mig_enabled:
        for j in range(_try(nvml, "nvmlDeviceGetMaxMigDeviceCount", handle) or 0):
            child = _try(nvml, "nvmlDeviceGetMigDeviceHandleByIndex", handle, j)
            if child is None:
                continue
            cmem = _try(nvml, "nvmlDeviceGetMemoryInfo", child)
            gpu.migs.append((_s(nvml.nvmlDeviceGetUUID(child)),
                             int(cmem.total) if cmem is not None else None))
    return gpu


def _version(value: Any) -> str | None:
    """13000 -> "13.0" (nvmlSystemGetCudaDriverVersion's encoding)."""
    if value is None:
        return None
    value = int(value)
    return f"{value // 1000}.{(value % 1000) // 10}"


def _candidates(phys: list[_Physical]) -> list[tuple[_Physical, str | None, int | None]]:
    """What CUDA enumerates: each GPU, or its MIG instances when MIG mode is on."""
    out = []
    for p in phys:
        if p.mig_enabled:
            out.extend((p, uuid, mem) for uuid, mem in p.migs)
        else:
            out.append((p, None, p.memory))
    return out


def select_visible(phys: list[_Physical], cvd: str | None
                   ) -> tuple[list[tuple[_Physical, str | None, int | None]], list[str]]:
    """Apply CUDA_VISIBLE_DEVICES to NVML's list; returns (devices, warnings)."""
    cands = _candidates(phys)
    if cvd is None:
        return cands, []
    chosen, cut = visibility.walk(cvd, lambda entry: _match(entry, phys, cands))
    if cut is None:
        return chosen, []
    return chosen, [f"CUDA_VISIBLE_DEVICES={cvd!r}: entry {cut.entry!r} {cut.what()} (NVML "
                    f"lists {len(phys)} GPU(s)); CUDA ignores it and every entry after it"]


def _match(entry: str, phys: list[_Physical], cands: list) -> tuple | None:
    if entry.isdigit():
        i = int(entry)
        if i >= len(phys):
            return None
        p = phys[i]
        mine = [c for c in cands if c[0] is p]
        return mine[0] if mine else None
    if entry.startswith("MIG-"):
        hits = [c for c in cands if c[1] and c[1].startswith(entry)]
    elif entry.startswith("GPU-"):
        hits = [c for c in cands if c[0].uuid.startswith(entry) and c[1] is None]
    else:
        return None
    return hits[0] if len(hits) == 1 else None


SMI_FIELDS = "index,name,uuid,memory.total,compute_cap,pci.bus_id,driver_version,mig.mode.current"


def _smi(exe: str, *args: str) -> str | None:
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def smi_physical(path: str) -> tuple[list[_Physical], str | None, str | None] | None:
    """(GPUs, driver, CUDA version) from nvidia-smi, or None when it is absent or fails."""
    exe = shutil.which("nvidia-smi", path=path)
    csv = _smi(exe, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits") if exe \
        else None
    if csv is None:
        return None
    phys, driver = [], None
    for line in csv.strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 8 or not f[0].isdigit():
            continue
        cc = f[4].split(".")
        phys.append(_Physical(
            index=int(f[0]), name=f[1], uuid=f[2],
            memory=int(f[3]) * 1024 ** 2 if f[3].isdigit() else None,
            arch=f"sm_{cc[0]}{cc[1]}" if len(cc) == 2 and all(c.isdigit() for c in cc) else None,
            bus_id=f[5], mig_enabled=f[7].lower() == "enabled"))
        driver = f[6]
    if any(p.mig_enabled for p in phys):
        _smi_migs(exe, phys)
    header = _smi(exe) or ""
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return phys, driver, cuda[1] if cuda else None


def _smi_migs(exe: str, phys: list[_Physical]) -> None:
    """MIG instance UUIDs from ``nvidia-smi -L`` (indented under their GPU)."""
    current = None
    for line in (_smi(exe, "-L") or "").splitlines():
        gpu = re.match(r"GPU (\d+):", line)
        if gpu:
            current = next((p for p in phys if p.index == int(gpu[1])), None)
            continue
        mig = re.search(r"UUID:\s*(MIG-[^)\s]+)", line)
        if mig and current is not None and current.mig_enabled:
            current.migs.append((mig[1], None))


@dataclass
class _Listing:
    """Every GPU NVML (or nvidia-smi) lists, before visibility is applied."""
    phys: list[_Physical]
    driver: Any
    cuda: str | None
    source: str
    notes: list[str]


def detect(vis: Visibility, nvml: Any | None = None, root: str = "/",
           load: bool = True, path: str = "") -> Hardware:
    """NVIDIA hardware visible to this process; no vendor (and a note why) when none.

    ``nvml`` is pynvml or a substitute with the same functions (tests inject one).
    """
    if (vis.nvidia_visible_devices or "").strip().lower() in ("none", "void"):
        return Hardware(notes=(f"NVIDIA_VISIBLE_DEVICES={vis.nvidia_visible_devices}: the "
                               "container runtime gave this container no GPUs",))
    if nvml is None and load:
        nvml = load_pynvml()
    listing = _list_by_smi(root, path) if nvml is None else _list_by_nvml(nvml, root)
    if isinstance(listing, Hardware):  # nothing could be listed: the result says why
        return listing
    if not listing.phys:
        return Hardware(notes=tuple(listing.notes))
    return _visible(listing, vis, root)


def _list_by_nvml(nvml: Any, root: str) -> _Listing | Hardware:
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return _no_nvml(root, _init_problem(nvml, exc))
    try:
        count = int(nvml.nvmlDeviceGetCount())
        phys = [_physical(nvml, i) for i in range(count)]
        driver = _try(nvml, "nvmlSystemGetDriverVersion")
        cuda = _version(_try(nvml, "nvmlSystemGetCudaDriverVersion"))
    except nvml.NVMLError as exc:
        return Hardware(warnings=(f"NVML failed while listing GPUs: {exc}",))
    finally:
        _try(nvml, "nvmlShutdown")
    return _Listing(phys, driver, cuda, source="nvml", notes=[])


def _list_by_smi(root: str, path: str) -> _Listing | Hardware:
    """Without the pynvml package: nvidia-smi on ``path`` stands in for NVML."""
    smi = smi_physical(path) if path else None
    if smi is None:
        return _no_nvml(root, "pynvml (nvidia-ml-py) is not installed")
    phys, driver, cuda = smi
    return _Listing(phys, driver, cuda, source="nvidia-smi",
                    notes=["pynvml (nvidia-ml-py) is not installed: read nvidia-smi instead"])


def _visible(listing: _Listing, vis: Visibility, root: str) -> Hardware:
    """The listed GPUs CUDA would use here, with notes and warnings on how they were chosen."""
    phys, notes = listing.phys, list(listing.notes)
    chosen, warnings = select_visible(phys, vis.cuda_visible_devices)
    if vis.cuda_visible_devices is not None:
        notes.append(f"CUDA_VISIBLE_DEVICES={vis.cuda_visible_devices!r} selects "
                     f"{len(chosen)} of {len(phys)} GPU(s) NVML lists")
    chosen, mig_warnings = _mig_limits(phys, chosen)
    gpus = tuple(Gpu(index=i, name=p.name + (" (MIG)" if mig else ""), uuid=mig or p.uuid,
                     memory_bytes=mem, arch=p.arch, physical_index=p.index, mig=bool(mig),
                     bus_id=p.bus_id, brand=p.brand) for i, (p, mig, mem) in enumerate(chosen))
    compat = Path(root) / CUDA_COMPAT_LIBCUDA
    driver = listing.driver
    return Hardware(vendor="nvidia", source=listing.source, gpus=gpus, listed=len(phys),
                    driver_version=_s(driver) if driver is not None else None,
                    cuda_driver_version=listing.cuda, notes=tuple(notes),
                    warnings=(*warnings, *mig_warnings),
                    cuda_compat=str(compat.resolve()) if compat.exists() else None)


def _mig_limits(phys: list[_Physical], chosen: list
                ) -> tuple[list[tuple[_Physical, str | None, int | None]], list[str]]:
    """(the devices one CUDA process can use, warnings): a GPU in MIG mode without
    instances offers none, and a process uses one MIG instance at most."""
    warnings = [f"GPU {p.index} ({p.name}) has MIG mode on but no MIG instances: CUDA "
                "cannot use it; create instances or disable MIG"
                for p in phys if p.mig_enabled and not p.migs]
    if sum(1 for c in chosen if c[1]) and len(chosen) > 1:
        warnings.append("MIG: one CUDA process uses one MIG instance; only the first is "
                        "counted. Run one process per pod/container, each given one instance "
                        "through CUDA_VISIBLE_DEVICES=MIG-<uuid> (Kubernetes: nvidia.com/mig-* "
                        "resources)")
        chosen = chosen[:1]
    return chosen, warnings


def _init_problem(nvml: Any, exc: Exception) -> str:
    if isinstance(exc, getattr(nvml, "NVMLError_LibraryNotFound", ())):
        return ("NVML library (libnvidia-ml.so.1) not found: no NVIDIA driver in this "
                "container")
    if isinstance(exc, getattr(nvml, "NVMLError_DriverNotLoaded", ())):
        return "NVIDIA driver not loaded on this host"
    return f"NVML could not start: {exc}"


def _no_nvml(root: str, why: str) -> Hardware:
    nodes = sorted(p.name for p in (Path(root) / "dev").glob("nvidia[0-9]*"))
    if nodes:  # device nodes without a usable NVML: a half-configured container
        return Hardware(warnings=(f"{why}, yet /dev has {', '.join(nodes)}: the NVIDIA "
                                  "container toolkit did not mount the driver libraries; run "
                                  "with --gpus all (or --runtime nvidia)",))
    return Hardware(notes=(why,))
