"""Remove torch and the vendor wheels a PyPI torch pulls (triton, nvidia-*, cuda-*) from
a pip-compile lock, in place: the project installs torch per variant (CPU, CUDA, ROCm),
never from a shared lock.

    python scripts/strip_vendor_wheels.py requirements/ft-py311.lock
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

VENDOR = re.compile(r"^(torch|triton|pytorch-triton\S*|nvidia-(?!ml-py)\S+|cuda-\S+)==")


def strip(text: str) -> str:
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        if line[:1] not in (" ", "\t", "#", "\n", ""):  # a new entry begins
            skipping = bool(VENDOR.match(line))
        elif line.startswith("#"):
            skipping = False
        if not skipping:
            out.append(line)
    return "".join(out)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        path = Path(name)
        path.write_text(strip(path.read_text()))
