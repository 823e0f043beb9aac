"""Crash-safe file writes and file digests, shared by every part that writes run state.

A reader (another rank, the launcher, a rerun after kill -9) must see either the old
file or the new one, never a torn one: write to a temporary name in the same folder,
flush and fsync it, then rename it over the target (``os.replace`` is atomic on POSIX
file systems). Torch-free, so the launcher can use it too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def fsync_file(path: Path) -> None:
    with Path(path).open("rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (the directory entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path, data: str | bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` in one step. durable=False skips the fsync (status
    files that only need to be whole, not to survive a power cut)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any, *, durable: bool = True) -> None:
    write_atomic(path, json.dumps(data, indent=2) + "\n", durable=durable)
