"""Visibility lists (``CUDA_VISIBLE_DEVICES``, ``ROCR_VISIBLE_DEVICES``, ...) applied the
way the GPU runtimes apply them, for both vendors.

Entries are taken in order; each names one device (an index, or a UUID prefix). The
first entry that matches nothing, or repeats a device, ends the list: the runtime
ignores it and everything after it. ``""`` and ``-1`` as the first entry hide every
device on purpose, which is no mistake.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Cut:
    """Where a list was cut short by mistake: the entry, and whether it repeated one."""
    entry: str
    repeat: bool

    def what(self) -> str:
        return "repeats a device" if self.repeat else "matches no device"


def walk(spec: str, match: Callable[[str], T | None]) -> tuple[list[T], Cut | None]:
    """The devices ``spec`` selects (``match`` maps one stripped entry to a device or None),
    and the mistaken entry that ended the list, if any."""
    chosen: list[T] = []
    for raw in spec.split(","):
        entry = raw.strip()
        hit = match(entry)
        if hit is None or hit in chosen:
            deliberate = entry in ("", "-1") and not chosen
            return chosen, None if deliberate else Cut(entry, repeat=hit is not None)
        chosen.append(hit)
    return chosen, None
