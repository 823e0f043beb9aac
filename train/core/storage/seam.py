"""Where a checkpoint's bytes live: the few operations the store needs, behind one seam.

The checkpoint store (:mod:`train.checkpoint.store`) speaks of names relative to a root
("checkpoints/step-4/state.pt", "checkpoints/latest"), never of paths, so that one
protocol (a partial folder, every file durable and hashed, ``checksums.json`` written
last, ``latest`` replaced atomically) holds whatever keeps the bytes.
:class:`~.local.LocalStorage`, a folder on a file system, is the first implementation;
:class:`~.bucket.S3Storage`, a key prefix of an S3-compatible bucket, the second, used by
the remote tier that mirrors sealed checkpoints (:mod:`train.checkpoint.tier`), not a
special case in the store.

:class:`Storage` is what any implementation provides. A file system adds what only it
can do (:mod:`.local`); an object store what only it can (:mod:`.bucket`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import BinaryIO, Protocol


class Storage(Protocol):
    def write(self, name: str, fill: Callable[[BinaryIO], None]) -> str:
        """A new file: ``fill`` writes its bytes; complete and durable when this returns.
        Returns its SHA-256, computed while writing (no second pass over the bytes)."""

    def replace(self, name: str, data: bytes) -> None:
        """A small file replaced in one step, durably: a reader sees the old or the new."""

    def open(self, name: str) -> BinaryIO:
        """A stored file, to read."""

    def digest(self, name: str) -> str:
        """The SHA-256 of a stored file, read back."""

    def names(self, folder: str = "") -> list[str]:
        """What a folder holds (names relative to it); none when it does not exist."""

    def exists(self, name: str) -> bool: ...

    def delete(self, name: str) -> None:
        """A file, or a folder with all it holds; nothing when it is not there."""
