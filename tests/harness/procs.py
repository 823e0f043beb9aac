"""The process tree, read from /proc: who is whose child, what a process runs and with
which environment. Linux only; a process that is gone has no children, no command line
and no environment (nothing here raises for it)."""

from __future__ import annotations

from pathlib import Path


def pids() -> list[int]:
    """Every process now, by PID."""
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def _tree() -> dict[int, list[int]]:
    """ppid -> its children (zombies included), from one pass over /proc."""
    children: dict[int, list[int]] = {}
    for pid in sorted(pids()):
        ppid = parent(pid)
        if ppid is not None:
            children.setdefault(ppid, []).append(pid)
    return children


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, lowest PID first."""
    return _tree().get(pid, [])


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``: its children, theirs, and so on."""
    tree = _tree()
    found, todo = set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def below(pid: int, ancestor: int) -> bool:
    """Is ``ancestor`` among ``pid``'s parents, grandparents...?"""
    while pid > 1:
        up = parent(pid)
        if up is None:
            return False
        pid = up
        if pid == ancestor:
            return True
    return False


def alive(pid: int) -> bool:
    """Running: a zombie, or a PID no longer there, is not."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def group(pgid: int) -> set[int]:
    """Every live process of process group ``pgid``."""
    found = set()
    for pid in pids():
        fields = _stat(pid)
        if fields and len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            found.add(pid)
    return found


def cmdline(pid: int) -> str:
    """The process's argv joined by spaces ("" once it is gone, or for a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def environ(pid: int) -> dict[str, str]:
    """The environment the process started with ({} once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0")
                if "=" in entry)


def loader_worker(pid: int, module: str) -> bool:
    """A DataLoader worker process of a worker running ``module``: forked by it, so it
    shows the same command line and environment, its parent's (torchrun, the parent of
    a worker, names ``module`` in another command line)."""
    up = parent(pid)
    return up is not None and module in cmdline(pid) and cmdline(up) == cmdline(pid)


def worker_of_rank(launcher: int, rank: str, module: str = "train.worker") -> int:
    """The worker below the launcher whose RANK is ``rank``: a training worker, or
    ``train.script`` for a script under ``launch``."""
    for pid in pids():
        if environ(pid).get("RANK") == rank and module in cmdline(pid) and \
                below(pid, launcher) and not loader_worker(pid, module):
            return pid
    raise AssertionError(f"no worker of rank {rank} below {launcher}")


def replica_workers(launcher: int, module: str = "train.worker") -> dict[int, int]:
    """Replica group -> the pid of its worker (rank 0 of the group), below the launcher
    (``distributed.fault_tolerance: replicas``)."""
    found = {}
    for pid in pids():
        env = environ(pid)
        if "REPLICA_GROUP_ID" in env and env.get("RANK", "0") == "0" and \
                module in cmdline(pid) and below(pid, launcher) and \
                not loader_worker(pid, module):
            found[int(env["REPLICA_GROUP_ID"])] = pid
    return found


def replica_ranks(launcher: int, module: str = "train.worker") -> dict[tuple[int, int], int]:
    """(replica group, rank in it) -> the pid of that worker, for every worker below the
    launcher (groups of several processes)."""
    found = {}
    for pid in pids():
        env = environ(pid)
        if "REPLICA_GROUP_ID" in env and module in cmdline(pid) and below(pid, launcher) \
                and not loader_worker(pid, module):
            found[(int(env["REPLICA_GROUP_ID"]), int(env.get("RANK", "0")))] = pid
    return found
