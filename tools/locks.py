"""Reading hash-locked requirement files (``requirements/*.lock``, pip-compile's format)."""

from __future__ import annotations

import re
from pathlib import Path

# name==version followed by its --hash lines (each on a continuation line)
_ENTRY = re.compile(r"^([a-z0-9][a-z0-9._-]*)==(\S+)((?:\s*\\\n\s+--hash=\S+)+)", re.M | re.I)


def entries(text: str) -> dict[str, str]:
    """Lower-cased name -> the entry as pip reads it (``name==version`` + hashes)."""
    return {name.lower(): f"{name}=={version}{hashes}"
            for name, version, hashes in _ENTRY.findall(text)}


# What pytest needs to run inside an image (the runtime lock may hold some already).
PYTEST_SET = ("pytest", "iniconfig", "pluggy", "packaging", "pygments")


def pytest_requirements(runtime_lock: Path, dev_lock: Path) -> str:
    """The hash-locked entries of pytest and its dependencies that the dev lock has beyond
    the runtime lock: what the image test installs into a throwaway folder."""
    runtime, dev = entries(runtime_lock.read_text()), entries(dev_lock.read_text())
    missing = sorted(set(PYTEST_SET) - dev.keys())
    if missing:
        raise ValueError(f"{dev_lock.name} lacks {missing}")
    return "".join(dev[name] + "\n" for name in sorted(set(PYTEST_SET) - runtime.keys()))


def hashes(text: str) -> dict[str, set[str]]:
    """Normalized name -> the SHA-256 digests its entry allows (one per wheel or sdist)."""
    return {re.sub(r"[-_.]+", "-", name).lower(): set(re.findall(r"--hash=sha256:([0-9a-f]{64})",
                                                                 block))
            for name, _, block in _ENTRY.findall(text)}
