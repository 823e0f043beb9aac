"""The processes a launch started: find them, and stop them without a checkpoint.

Read from /proc, where the launcher sees its processes numbered as it numbers them (in a
container, or a simulated node with its own /proc). torchrun starts each worker in a
session of its own, so a process group does not reach them.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

from launcher.planning.plan import SCRIPT_MODULE, WORKER_MODULE


def stop_workers(torchrun_pid: int, what: str, then: str,
                 log: Callable[[str], None], status_dir: str | None = None) -> None:
    """Peers vanished: this node's workers wait for them in a collective until its
    timeout. Stop them at once (they resume from the last checkpoint): an elastic job's
    torchrun then meets the nodes that are left (a restart, as when a worker dies), a
    static job's ends. ``what``: which node, and how it was noticed; ``status_dir``: the
    workers' status folder, where torchrun's agent learns why they were killed."""
    from launcher.endings.restarts import note_stop
    log(f"{what}; stopping this node's workers {then}")
    note_stop(status_dir, what)
    for victim in descendants(torchrun_pid):
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


WORKER_MODULES = (WORKER_MODULE, SCRIPT_MODULE)


def workers_alive(torchrun_pid: int) -> bool:
    """Does torchrun have training workers running (not: meeting, or restarting)?"""
    for pid in descendants(torchrun_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(m.encode() in argv for m in WORKER_MODULES):
            return True
    return False


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (torchrun's workers are in sessions of
    their own, and a SIGTERM would make them write a checkpoint)."""
    for victim in [pid, *descendants(pid)]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
