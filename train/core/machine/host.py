"""Facts about the machine and image that both the launcher and the worker need:
the CPUs this process may really use, and the image's build manifest.

Torch-free and side-effect free, so the launcher can call it before any worker starts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

# Written by scripts/build-manifest when the image is built; TRAIN_BUILD_MANIFEST
# points elsewhere (tests, a checkout).
DEFAULT_BUILD_MANIFEST = "/app/build-manifest.json"


def available_cpus(root: str | Path = "/") -> int:
    """CPUs this process may use: the affinity mask, capped by the cgroup CPU quota.

    ``os.cpu_count()`` reports the host's cores, which oversubscribes a container
    limited to a few CPUs (a classic slowdown of every rank's thread pool). A quota of
    1.5 CPUs counts as 2. ``root`` stands in for ``/`` in tests.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    root = Path(root)
    try:
        membership = (root / "proc/self/cgroup").read_text()
    except OSError:
        membership = ""
    quota = cgroup_cpu_quota(root / "sys/fs/cgroup", membership)
    if quota is not None:
        cpus = min(cpus or 1, max(1, math.ceil(quota)))
    return max(1, cpus or 1)


def cgroup_cpu_quota(cgroup: Path, membership: str = "") -> float | None:
    """CPUs allowed by the CPU quota of this process's cgroup and of every group above it
    (the smallest of them; v2 ``cpu.max``, else v1's ``cpu/cpu.cfs_quota_us``); None: no
    limit.

    ``cgroup`` is where the hierarchy is mounted; ``membership`` the text of
    /proc/self/cgroup, which names this process's group in it. In a container with its
    own cgroup namespace that is ``/`` (the mount is the container's group); on a host,
    a CI runner's slice or a group made by hand it is a folder further down, whose
    quota the mount's top never shows. A group named there but not present under the
    mount (a container without its own namespace sees its host's path) counts as the top.
    """
    v2 = _cgroup_path(membership, v2=True)
    quotas = [q for q in (_v2_quota(d) for d in _chain(cgroup, v2)) if q is not None]
    if not quotas:
        v1 = _cgroup_path(membership, v2=False)
        quotas = [q for q in (_v1_quota(d) for d in _chain(cgroup / "cpu", v1))
                  if q is not None]
    return min(quotas) if quotas else None


def _cgroup_path(membership: str, *, v2: bool) -> str:
    """This process's group in the v2 hierarchy, or in v1's cpu controller's; "/" if unknown."""
    for line in membership.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if (v2 and hierarchy == "0" and not controllers) or \
                (not v2 and "cpu" in controllers.split(",")):
            return path.strip() or "/"
    return "/"


def _chain(mount: Path, group: str) -> list[Path]:
    """The group's folder under the mount and each folder above it, up to the mount."""
    parts = [p for p in group.split("/") if p and p not in (".", "..")]
    if not (mount.joinpath(*parts)).is_dir():
        parts = []
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(group: Path) -> float | None:
    try:
        text = (group / "cpu.max").read_text().split()  # "max 100000" or "200000 100000"
        return int(text[0]) / int(text[1]) if text and text[0] != "max" else None
    except (OSError, ValueError, IndexError, ZeroDivisionError):
        return None


def _v1_quota(group: Path) -> float | None:
    try:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def available_memory(root: str | Path = "/") -> int | None:
    """Bytes this process could still allocate: MemAvailable, capped by the cgroup's
    memory limit minus its usage (v2, else v1). None when unknown."""
    root = Path(root)
    found = None
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cgroup = root / "sys/fs/cgroup"
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes",
                                    "memory/memory.usage_in_bytes")):
        try:
            limit = (cgroup / limit_file).read_text().strip()
            usage = int((cgroup / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # v1 reports "no limit" as ~2**63
            left = max(0, int(limit) - usage)
            found = left if found is None else min(found, left)
        break
    return found


OUTPUT_DIR_FIX = ("mount a writable volume there (docker run -v $PWD/runs:/workspace/runs), "
                  "check its owner against the container user, or set output.dir; on "
                  "Kubernetes with an NFS or other RWX volume, fsGroup is not applied: make "
                  "it writable for group 0 once (k8s/tools/volume-permissions.yaml)")


def output_dir_problem(path: str | Path, create: bool) -> str | None:
    """Why runs cannot be written under ``path``, or None. create=False writes nothing
    (doctor, --dry-run): it looks at the nearest folder that exists."""
    target = Path(path)
    if not create:
        base = target.absolute()
        while not base.exists() and base != base.parent:
            base = base.parent
        if base.is_dir() and os.access(base, os.W_OK | os.X_OK):
            return None
        why = "is not a directory" if not base.is_dir() else "denies writing"
        return f"output.dir {target} is not writable ({base} {why})"
    try:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target, prefix=".write-test-"):
            pass
    except OSError as exc:
        return f"output.dir {target} is not writable: {exc.strerror or exc}"
    return None


PR_SET_PDEATHSIG = 1


def process_alive(pid: object) -> bool:
    """Whether a process with this pid exists (one of another user's counts)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent(signum: int, parent: int | None = None) -> None:
    """Have the kernel send ``signum`` to this process when its parent dies, however it
    dies (kill -9 included), so supervised processes never outlive their supervisor.
    Linux only (prctl); elsewhere nothing happens. ``parent``: the pid that must still
    be the parent (the race of a parent dying before this call ends the process)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signum)


def exit_now(code: int) -> NoReturn:
    """End a process (a worker, torchrun, the launcher) with ``code`` once its work is
    done and its files written, without the interpreter's finalisation. There, the
    destructors of torch's C++ threads of a gloo process group aborted a rank now and
    then ("terminate called without an active exception", exit -6) after a run had
    finished and saved, which read as a failure; and tearing down a process that loaded
    torch costs about 0.6 s of CPU, which a node held to a few percent of a CPU turns
    into tens of seconds, past SLURM's KillWait after a stop (docs/slurm.md). Logs and
    output are flushed first; nothing here relies on atexit, and the threads still
    running are daemons."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def read_build_manifest(path: str | Path) -> dict | None:
    """The image's build manifest as a dict; None outside the image or when unreadable."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else {"value": data}
