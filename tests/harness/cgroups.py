"""A slow node made real: processes held to a share of one CPU by a cgroup quota (a
throttled GPU, a noisy neighbour, a starved container look like this to the job).

cgroup v2 (``cpu.max``) or v1's cpu controller (``cpu.cfs_quota_us``), whichever the
machine mounts; the group is created under the root and removed by :meth:`close`, its
processes moved back first. Needs root; :func:`available` says why not, for a skip.
"""

from __future__ import annotations

import uuid
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def _root() -> tuple[Path, int] | None:
    controllers = V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return V2, 2
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1, 1
    return None


def available() -> str | None:
    """None when this machine can hold processes to a CPU quota, else why not."""
    root = _root()
    if root is None:
        return "no cgroup cpu controller mounted (v2 cpu.max or v1 cpu.cfs_quota_us)"
    try:
        probe = CpuLimit(0.5)
    except OSError as exc:
        return f"cannot create a cgroup: {exc}"
    probe.close()
    return None


class CpuLimit:
    """Processes added run on at most ``cpus`` of one CPU, together."""

    def __init__(self, cpus: float) -> None:
        root = _root()
        if root is None:
            raise OSError("no cgroup cpu controller")
        self.root, self.version = root
        self.path = self.root / f"trn-slow-{uuid.uuid4().hex[:8]}"
        if self.version == 2:
            (self.root / "cgroup.subtree_control").write_text("+cpu")
        self.path.mkdir()
        quota = max(1000, int(cpus * PERIOD_US))
        if self.version == 2:
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def add(self, pid: int) -> None:
        """The process and all its threads (children it starts later follow it)."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def release(self) -> None:
        """Every process back to the root group: no limit any more."""
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.root / "cgroup.procs").write_text(pid)
            except OSError:  # it ended meanwhile
                pass

    def close(self) -> None:
        if self.path.exists():
            self.release()
            self.path.rmdir()
