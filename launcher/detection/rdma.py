"""RDMA (InfiniBand / RoCE) as NCCL and RCCL will find it, for ``doctor``.

Multi-node NCCL/RCCL use RDMA only when three things meet: the host's RDMA devices
(``/sys/class/infiniband/<dev>``, with an ACTIVE port), their device files inside the
container (``/dev/infiniband/uverbs*``: ``--device=/dev/infiniband`` for docker, an
RDMA device plugin on Kubernetes), and the verbs library in the image
(``libibverbs.so.1`` plus the providers). Miss one and NCCL falls back to TCP sockets
without an error: the run works, several times slower between nodes. This module reads
the three from sysfs, /dev and the dynamic loader (nothing is opened or configured) and
says which transport NCCL will pick; ``NCCL_IB_DISABLE=1`` or ``NCCL_NET=Socket`` choose
sockets on purpose.

Reference: NCCL's environment variables (NCCL_IB_DISABLE, NCCL_NET, NCCL_IB_HCA),
https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from pathlib import Path

from launcher.detection.hardware import Finding

VERBS_LIBRARY = "libibverbs.so.1"
RDMA_PACKAGES = "libibverbs1 ibverbs-providers librdmacm1"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def verbs_loadable() -> bool:
    """Whether this image's dynamic loader finds the verbs library (as NCCL dlopens it)."""
    try:
        ctypes.CDLL(VERBS_LIBRARY)
    except OSError:
        return False
    return True


def detect(root: str = "/", env: Mapping[str, str] | None = None,
           verbs: Callable[[], bool] = verbs_loadable) -> dict:
    """Devices and ports from sysfs, device files, the verbs library, NCCL's choice."""
    env = env or {}
    base = Path(root)
    devices = []
    for dev in sorted((base / "sys/class/infiniband").glob("*")):
        ports = []
        for port in sorted((dev / "ports").glob("*"), key=lambda p: p.name):
            state = _read(port / "state")  # "4: ACTIVE"
            ports.append({"port": port.name, "state": state.split(": ")[-1] or "?",
                          "link_layer": _read(port / "link_layer") or "?",  # Ethernet: RoCE
                          "rate": _read(port / "rate")})
        devices.append({"name": dev.name, "ports": ports})
    uverbs = sorted(p.name for p in (base / "dev/infiniband").glob("uverbs*"))
    active = [d["name"] for d in devices if any(p["state"] == "ACTIVE" for p in d["ports"])]
    library = verbs() if devices else None  # no devices: nothing to load it for
    disabled = env.get("NCCL_IB_DISABLE") == "1" or env.get("NCCL_NET", "").lower() == "socket"
    usable = bool(active and uverbs and library and not disabled)
    return {"devices": devices, "active": active, "device_files": uverbs,
            "verbs_library": library, "nccl_transport": "IB" if usable else "Socket",
            "disabled_by_env": disabled}


def findings(info: dict, multi_node_gpu: bool) -> list[Finding]:
    """Warnings when RDMA exists but NCCL/RCCL cannot use it (only where it matters:
    GPUs across nodes). Never a failure: sockets work, only slower."""
    if not info["devices"] or info["disabled_by_env"] or not multi_node_gpu:
        return []
    if not info["active"]:
        names = ", ".join(d["name"] for d in info["devices"])
        return [Finding("warn", "rdma", f"RDMA device(s) {names} "
                        "have no ACTIVE port: NCCL will use TCP sockets between nodes",
                        "check the fabric (ibstat on the host)")]
    if not info["device_files"]:
        return [Finding("warn", "rdma", f"the host has RDMA device(s) {', '.join(info['active'])} "
                        "but this container has no /dev/infiniband/uverbs*: NCCL will use TCP "
                        "sockets between nodes", "docker: --device=/dev/infiniband; Kubernetes: "
                        "an RDMA device plugin resource (e.g. rdma/hca) in the pod's limits")]
    if not info["verbs_library"]:
        return [Finding("warn", "rdma", f"RDMA device(s) {', '.join(info['active'])} are present "
                        f"but {VERBS_LIBRARY} is not in this image: NCCL will use TCP sockets "
                        "between nodes", f"use the CUDA/ROCm image (it has {RDMA_PACKAGES})")]
    return [Finding("ok", "rdma", f"RDMA {', '.join(info['active'])}: NCCL/RCCL can use "
                    "InfiniBand/RoCE between nodes")]


def line(info: dict) -> str:
    """doctor's one-line summary."""
    if not info["devices"]:
        return "none (/sys/class/infiniband is empty); NCCL between nodes: TCP sockets"
    ports = ", ".join(f"{d['name']}/{p['port']} {p['state']} {p['link_layer']}"
                      + (f" {p['rate']}" if p["rate"] else "")
                      for d in info["devices"] for p in d["ports"])
    return (f"{ports}; /dev/infiniband: {', '.join(info['device_files']) or 'absent'}; "
            f"{VERBS_LIBRARY}: {'found' if info['verbs_library'] else 'missing'}; "
            f"NCCL between nodes: {info['nccl_transport']}"
            + (" (NCCL_IB_DISABLE / NCCL_NET chose sockets)" if info["disabled_by_env"] else ""))
