"""Facts about the machine and image that both the launcher and the worker need:
the CPUs this process may really use, and the image's build manifest.

Torch-free and side-effect free, so the launcher can call it before any worker starts.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

# Written by scripts/build-manifest when the image is built; TRAIN_BUILD_MANIFEST
# points elsewhere (tests, a checkout).
DEFAULT_BUILD_MANIFEST = "/app/build-manifest.json"


def available_cpus(root: str | Path = "/") -> int:
    """CPUs this process may use: the affinity mask, capped by the cgroup CPU quota.

    ``os.cpu_count()`` reports the host's cores, which oversubscribes a container
    limited to a few CPUs (a classic slowdown of every rank's thread pool). ``root``
    stands in for ``/`` in tests.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cgroup_cpu_quota(Path(root) / "sys/fs/cgroup")
    if quota is not None:
        cpus = min(cpus or 1, max(1, math.ceil(quota)))
    return max(1, cpus or 1)


def cgroup_cpu_quota(cgroup: Path) -> float | None:
    """CPUs allowed by the cgroup quota (v2 ``cpu.max``, else v1 CFS files); None: no limit."""
    try:
        text = (cgroup / "cpu.max").read_text().split()  # "max 100000" or "200000 100000"
        return int(text[0]) / int(text[1]) if text and text[0] != "max" else None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def read_build_manifest(path: str | Path) -> dict | None:
    """The image's build manifest as a dict; None outside the image or when unreadable."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else {"value": data}
