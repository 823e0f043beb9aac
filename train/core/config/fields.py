"""How a config field is declared: its default, its one-line doc and its numeric bounds,
which the loader checks and the reference (docs/config.md, configs/schema.json) prints."""

from __future__ import annotations

from dataclasses import field
from typing import Any

AUTO = "auto"


def opt(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None,
        le: float | None = None, factory: bool = False) -> Any:
    """A config field with its one-line doc and optional numeric bounds."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le}
    if factory:
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)
