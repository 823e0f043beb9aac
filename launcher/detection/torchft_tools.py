"""torchft on this machine, for ``distributed.fault_tolerance: replicas``: its Python
package (the workers' Manager) and its ``torchft_lighthouse`` binary (the quorum
service the launcher starts). Both come with the ``ft`` extra.

Found without importing torchft (it imports torch): the package by its import spec, the
binary next to this interpreter (a virtual environment's ``bin/``, where pip puts it)
and else on ``PATH``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from launcher.detection.hardware import Finding

LIGHTHOUSE = "torchft_lighthouse"
INSTALL = "pip install 'trainpod[ft]' (in a checkout: make ft)"


def lighthouse_binary(executable: str | None = None, path: str | None = None) -> str | None:
    """The Lighthouse's binary: beside ``executable`` (this interpreter), else on
    ``path`` (``PATH``); None when neither has it."""
    beside = Path(executable or sys.executable).parent / LIGHTHOUSE
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(LIGHTHOUSE, path=path if path is not None else os.environ.get("PATH"))


def torchft_found() -> bool:
    """Is the torchft package importable here (found, not imported)?"""
    try:
        return importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):
        return False


def check(binary: str | None, package: bool) -> list[Finding]:
    """The finding of replica groups' prerequisites: ok, or exit 3 with the install line."""
    missing = [*([] if package else ["the torchft package is not importable"]),
               *([] if binary else [f"no {LIGHTHOUSE} binary (beside {sys.executable} or on "
                                    "PATH)"])]
    if not missing:
        return [Finding("ok", "fault tolerance", f"torchft found; its Lighthouse: {binary}")]
    return [Finding("fail", "fault tolerance",
                    f"distributed.fault_tolerance=replicas needs torchft, but "
                    f"{' and '.join(missing)}", INSTALL, 3)]
