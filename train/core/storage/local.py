"""A folder on a file system as a :class:`~.seam.Storage`.

A file system adds what only it can do: rename a folder atomically
(:meth:`LocalStorage.move`: how a partial checkpoint is sealed) and give a library a real
path to write into (:meth:`LocalStorage.path`: torch.distributed.checkpoint writes its
shards itself).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from train.core.bulk import BulkFile
from train.core.files import fsync_dir, sha256_file, write_atomic


class LocalStorage:
    """A folder on a file system. No file is written through a symbolic link (a new
    file replaces a link at its name); folders may be links (checkpoints on another
    disk)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, name: str = "") -> Path:
        return self.root / name if name else self.root

    def write(self, name: str, fill: Callable[[BinaryIO], None]) -> str:
        """Large buffers, hashed in one thread and written in another while ``fill``
        produces the next (:class:`~train.core.bulk.BulkFile`); fsync'ed at the end."""
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with BulkFile(path) as f:
            fill(f)
        return f.digest

    def replace(self, name: str, data: bytes) -> None:
        write_atomic(self.path(name), data)
        fsync_dir(self.path(name).parent)  # the rename itself survives a power cut

    def open(self, name: str) -> BinaryIO:
        return self.path(name).open("rb")

    def read_text(self, name: str) -> str:
        return self.path(name).read_text(encoding="utf-8")

    def digest(self, name: str) -> str:
        return sha256_file(self.path(name))

    def names(self, folder: str = "") -> list[str]:
        path = self.path(folder)
        return sorted(p.name for p in path.iterdir()) if path.is_dir() else []

    def exists(self, name: str) -> bool:
        return self.path(name).exists()

    def is_folder(self, name: str) -> bool:
        return self.path(name).is_dir()

    def size(self, name: str) -> int:
        """Bytes of a file, or of every file under a folder (a sharded checkpoint keeps
        its shards in a subfolder); links are not followed."""
        path = self.path(name)
        if not path.is_dir():
            return path.stat().st_size
        return sum(os.lstat(os.path.join(top, f)).st_size
                   for top, _, files in os.walk(path) for f in files
                   if not os.path.islink(os.path.join(top, f)))

    def delete(self, name: str) -> None:
        path = self.path(name)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_symlink() or path.exists():
            path.unlink(missing_ok=True)

    def move(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` (a file or a folder) atomically, durably."""
        self.path(dst).parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.path(src), self.path(dst))
        fsync_dir(self.path(dst).parent)

    def folder(self, name: str) -> LocalStorage:
        """The storage of a subfolder (a checkpoint's own files)."""
        return LocalStorage(self.path(name))
