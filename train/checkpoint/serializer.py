"""What a rank writes for a checkpoint, and the words for a write that failed.

``save_object``: torch.save into a new file of a storage (durable, hashed while
written). ``snapshot``: a CPU copy that training can no longer change (for a write in
the background). ``writing``: a failed write (a full disk, a read-only file system)
becomes one line, :func:`write_error`, with the free space and the size a checkpoint
takes, and the partial checkpoint goes with it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from train.core.errors import CannotRunHere
from train.core.run import rundir
from train.core.storage.local import LocalStorage


class CheckpointWriteError(CannotRunHere):
    """A checkpoint could not be written (disk full, quota, a read-only file system): exit
    3, since a restart cannot free a disk. The partial checkpoint is removed and the
    previous one is intact; a restart of the same attempt ends at once (train.worker)."""


def save_object(storage: LocalStorage, name: str, obj: Any) -> str:
    """torch.save ``obj`` as ``name``; its SHA-256."""
    import torch
    with without_zip_crc():
        return storage.write(name, lambda f: torch.save(obj, f))


_CRC_LOCK = threading.Lock()
_crc_off: list = []  # the setting before the first of the writes now running turned it off


@contextlib.contextmanager
def without_zip_crc():
    """torch.save without the CRC-32 of each record in its zip container: the file's
    SHA-256 (checksums.json, verified on every load) already covers every byte, and the
    CRC was most of torch.save's own CPU time (about 0.75 CPU-s per GB here). torch.load
    does not check it. The setting is torch's, process-wide, read when a save starts:
    off while any checkpoint write runs (a background one may overlap a foreground
    one), restored when the last one ends."""
    from torch.serialization import get_crc32_options, set_crc32_options
    with _CRC_LOCK:
        _crc_off.append(get_crc32_options() if not _crc_off else _crc_off[0])
        set_crc32_options(False)
    try:
        yield
    finally:
        with _CRC_LOCK:
            before = _crc_off.pop()
            if not _crc_off:
                set_crc32_options(before)


def save_file(obj: Any, path: Path) -> str:
    """torch.save ``obj`` to ``path``, durably, never through a link; its SHA-256."""
    return save_object(LocalStorage(Path(path).parent), Path(path).name, obj)


@contextlib.contextmanager
def writing(storage: LocalStorage, partial: str, name: str):
    """A failed write of ``name`` (in the checkpoint ``partial``) is one
    CheckpointWriteError; the partial checkpoint goes with it (left behind, it would
    keep a full disk full)."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        if isinstance(exc, CheckpointWriteError):
            raise
        needed = _latest_size(storage)
        storage.delete(partial)
        raise write_error(exc, storage.path(name), needed,
                          storage.path(rundir.CHECKPOINTS)) from exc


def _latest_size(storage: LocalStorage) -> int | None:
    """About how many bytes a checkpoint takes: the newest one's."""
    name = rundir.latest_name(storage.path(rundir.CHECKPOINTS))
    try:
        return storage.size(f"{rundir.CHECKPOINTS}/{name}") if name else None
    except OSError:
        return None


def write_error(exc: BaseException, path: Path, needed: int | None = None,
                folder: Path | None = None) -> CheckpointWriteError:
    """Say what went wrong in words: torch reports a full disk as "[enforce fail at
    inline_container.cc] unexpected pos" or "file write failed". needed: about how many
    bytes a checkpoint takes (the previous one's size), when known; folder: the
    checkpoints folder (default: the one above ``path``'s step folder)."""
    folder = folder or path.parent.parent  # checkpoints/
    label = path.relative_to(folder) if folder in path.parents else path.name
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    sizes = [f"{_mib(free)} free"] if free is not None else []
    if needed:
        sizes.append(f"a checkpoint takes about {_mib(needed)}")
    left = f" ({', '.join(sizes)})" if sizes else ""
    short_write = any(s in str(exc) for s in ("unexpected pos", "file write failed"))
    code = getattr(exc, "errno", None)
    if code == errno.EROFS:
        what = f"{folder} is on a read-only file system now"
    elif code in (errno.EACCES, errno.EPERM):
        what = f"{folder} is no longer writable ({os.strerror(code)})"
    elif code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or \
            (code is None and free is not None and free < 64 << 20):
        what = f"no space left on {folder}{left}: free some, or lower checkpoint.keep_last"
    elif short_write:  # torch's words for a write the file system cut short
        what = f"the write was cut short: is the disk holding {folder} full{left}?"
    else:
        what = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return CheckpointWriteError(f"cannot write checkpoint {label}: {what}; the previous "
                                "checkpoint is intact")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 10 << 20 else f"{n / 2**20:.0f} MiB"


def snapshot(state: Any) -> Any:
    """A CPU copy that training can no longer mutate (for writing in the background)."""
    import torch
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor)
                    else t, state)
