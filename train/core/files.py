"""Crash-safe file writes and file digests, shared by every part that writes run state.

A reader (another rank, the launcher, a rerun after kill -9) must see either the old
file or the new one, never a torn one: write to a temporary name in the same folder,
flush and fsync it, then rename it over the target (``os.replace`` is atomic on POSIX
file systems). Torch-free, so the launcher can use it too.

No write follows a symbolic link: a link planted at a file's name in the run directory
(``config.yaml -> ~/.bashrc``) would otherwise have the run overwrite whatever it points
at. The temporary file is created new (``O_EXCL | O_NOFOLLOW``, after removing any
leftover of that name), and the rename replaces a link at the target name instead of
writing through it; files opened in place (appended to, locked) refuse a link
(:class:`LinkRefused`). Directories may be links (checkpoints on another disk).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import socket
import threading
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from train.core.run import rundir


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


class LinkRefused(OSError):
    """A symbolic link stands where a file of the run is opened in place."""


def refusing_links(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` with O_NOFOLLOW: a link at ``path`` is :class:`LinkRefused`, naming it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LinkRefused(errno.ELOOP, f"{path} is a symbolic link; the run writes no "
                                           "file through a link: remove it") from None
        raise


def create_new_fd(path: Path) -> int:
    """A new file at ``path`` opened for writing (a descriptor), whatever stood there
    before (a leftover, or a link, is removed first; the file it pointed at is untouched)."""
    path = Path(path)
    if path.is_symlink() or path.exists():
        path.unlink()
    return refusing_links(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)


def create_new(path: Path) -> BinaryIO:
    """:func:`create_new_fd` as a file object."""
    return os.fdopen(create_new_fd(path), "wb")


def open_append(path: Path) -> TextIO:
    """``path`` opened to append lines (created when missing); a link is refused."""
    fd = refusing_links(Path(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    return os.fdopen(fd, "a", buffering=1, encoding="utf-8")


def write_atomic(path: Path, data: str | bytes, *, durable: bool = True,
                 shared: bool = False) -> None:
    """Replace ``path`` with ``data`` in one step, never writing through a link.
    durable=False skips the fsync (status files that only need to be whole); shared: other
    processes (other hosts) may write the same file at the same time, so the temporary
    name is this process's and thread's own."""
    path = Path(path)
    own = f".{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}" if shared else ""
    tmp = path.with_name(f"{path.name}{own}.tmp")
    with create_new(tmp) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def json_text(data: Any, indent: int | None = None) -> str:
    """Strict JSON: NaN and infinities (which JSON does not have) are written as null.
    (Written as they are first: the walk that replaces them is done only when one is
    there, since a metrics line of every logging step goes through here.)"""
    try:
        return json.dumps(data, indent=indent, allow_nan=False)
    except ValueError:  # NaN or an infinity somewhere
        return json.dumps(_finite(data), indent=indent, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json_atomic(path: Path, data: Any, *, durable: bool = True) -> None:
    write_atomic(path, json_text(data, indent=2) + "\n", durable=durable)


def describe_load_error(exc: BaseException) -> str:
    """One line for a torch.load failure, without torch's advice to retry with
    weights_only=False (which would run whatever code the file carries)."""
    text = " ".join(str(exc).split())
    if "WeightsUnpickler error:" in text:  # the reason, after torch's advice
        text = text.split("WeightsUnpickler error:", 1)[1]
        text = text.split("Please use `torch.serialization", 1)[0]
    text = text.split("Re-running `torch.load`", 1)[0].split("(1) In PyTorch", 1)[0].strip()
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def finished_step(run_dir: Path, max_steps: int) -> int | None:
    """The step of a finished run (its result.json reaching ``max_steps``), else None:
    the one file that says there is nothing left to do, read before anything is built."""
    try:
        step = json.loads((Path(run_dir) / rundir.RESULT).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and step >= max_steps else None
