"""The token file ``data.kind: tokens`` reads, written whole or not at all.

The format is the reader's (:func:`train.data.builders.tokens`): token ids as raw
native-endian ``uint16``, no header, one id after another, memory-mapped. A file that
describes it sits beside it, ``FILE.json`` (:func:`sidecar_path`): the token count, the
file's SHA-256, the vocabulary and the tokenizer that made it, so a run can record which
tokenizer made its data.

A writer streams ids into ``FILE.partial`` (fsync'ed when complete), writes the
description, then renames the partial file to ``FILE`` and fsyncs the folder: a process
killed at any moment leaves either no ``FILE`` or the previous one, never a torn one under
the final name. A leftover ``FILE.partial`` is replaced by the next write.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from train.core.files import create_new_fd, fsync_dir, write_json_atomic

# Token id types, smallest first. The tokens kind reads uint16 only, so a vocabulary
# above 65,536 ids has no type here yet (it would need the reader to learn uint32).
DTYPES = (("uint16", 1 << 16),)
PARTIAL = ".partial"


def dtype_for(vocab_size: int) -> str | None:
    """The smallest id type that holds every id below ``vocab_size`` (None: none does)."""
    for name, ids in DTYPES:
        if vocab_size <= ids:
            return name
    return None


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_sidecar(path: Path) -> dict[str, Any] | None:
    """The description beside a token file, when there is a readable one."""
    try:
        data = json.loads(sidecar_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class TokenFileWriter:
    """Appends ids to ``path`` + ``.partial``; :meth:`commit` makes it ``path``, with its
    description beside it; :meth:`discard` removes the partial file."""

    def __init__(self, path: Path, dtype: str = "uint16"):
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self.partial = self.path.with_name(self.path.name + PARTIAL)
        self._fd = create_new_fd(self.partial)  # a leftover of a killed run is replaced
        self._hash = hashlib.sha256()
        self.count = 0

    def append(self, ids: np.ndarray) -> None:
        data = np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self._hash.update(data)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        self.count += len(ids)

    def commit(self, description: dict[str, Any]) -> dict[str, Any]:
        """Durably complete the file and its description; returns the description written."""
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        record = {"format": "tokens", "dtype": self.dtype.name, "tokens": self.count,
                  "sha256": self._hash.hexdigest(), **description}
        # the description first: whenever the new FILE exists, so does its description
        write_json_atomic(sidecar_path(self.path), record)
        os.replace(self.partial, self.path)
        fsync_dir(self.path.parent)
        return record

    def discard(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.partial.unlink(missing_ok=True)
