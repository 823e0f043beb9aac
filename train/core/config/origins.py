"""Where each value of a config came from: the command line, the file, or the default.

Every error and warning about a key names the value's origin (``command line`` for a
``key=value`` override, else the file), and any other value it quotes says where that
one came from when it differs (``train.max_steps=10 (command line)``). The loader
records the origins while it reads (:class:`Sources`); the checks, the placement rules
and the launch plan read them back from the loaded config.
"""

from __future__ import annotations

import json
import re
from typing import Any

CLI = "command line"
DEFAULT = "default"


class Sources:
    """Where each value came from: the command line (a ``key=value`` override), the
    file, or neither (the schema's default). ``overridden`` and ``in_file`` hold every
    dotted path each one set (a section given whole sets the paths inside it)."""

    def __init__(self, file: str, overridden: set[str] = frozenset(),
                 in_file: set[str] = frozenset()) -> None:
        self.file, self.overridden, self.in_file = file, set(overridden), set(in_file)

    def from_cli(self, key: str) -> bool:
        """The command line set ``key`` (or, for a mapping value, part of it)."""
        return any(within(k, key) for k in self.overridden)

    def origin(self, key: str) -> str:
        """CLI, the file's path, or :data:`DEFAULT`."""
        if self.from_cli(key):
            return CLI
        return self.file if any(within(k, key) for k in self.in_file) else DEFAULT

    def of(self, key: str) -> str:
        """The source an error about ``key`` names: the command line when the value came
        from there, else the file (also for a default: the file did not set it)."""
        return CLI if self.from_cli(key) else self.file

    def note(self, key: str, line_source: str) -> str:
        """`` (where key's value came from)`` when that is not ``line_source``, else ``""``."""
        origin = self.origin(key)
        return "" if origin == line_source else f" ({origin})"


def related(a: str, b: str) -> bool:
    """The same key, or one is a section holding the other."""
    return within(a, b) or within(b, a)


def within(path: str, key: str) -> bool:
    """``path`` is ``key`` or lies inside it."""
    return path == key or path.startswith(key + ".")


def paths_in(tree: Any, prefix: str = "") -> set[str]:
    """Every dotted path a YAML tree sets (sections and values)."""
    out: set[str] = set()
    if isinstance(tree, dict):
        for name, value in tree.items():
            dotted = f"{prefix}{name}"
            out.add(dotted)
            out |= paths_in(value, dotted + ".")
    return out


def source_of(cfg: Any, key: str, fallback: str) -> str:
    """What an error about ``key`` of a loaded config names (command line or its file);
    ``fallback`` for a config not made by :func:`load_config`."""
    sources = getattr(cfg, "_sources", None)
    return sources.of(key) if sources is not None else fallback


def origin_note(cfg: Any, key: str, line_source: str) -> str:
    """`` (command line)``, `` (FILE)`` or `` (default)`` for a value of ``cfg`` that did
    not come from ``line_source``; ``""`` otherwise or when unknown."""
    sources = getattr(cfg, "_sources", None)
    return sources.note(key, line_source) if sources is not None else ""


def config_warnings(cfg: Any) -> list[str]:
    """The warnings loading ``cfg`` gave (``<file>: <key>: ...``, as errors read): values
    it adjusted, such as a warmup longer than the run."""
    return list(getattr(cfg, "_warnings", ()))


# In a check's message: ref(key) quotes "key=value", val(key) the value alone; validate
# adds where the value came from when that is not the error line's source.
QUOTED = re.compile(r"\x00([rv]):([^\x00]+)\x00")


def ref(key: str) -> str:
    return f"\x00r:{key}\x00"


def val(key: str) -> str:
    return f"\x00v:{key}\x00"


MISSING = object()


def dig(tree: dict, dotted: str) -> Any:
    """The value at a dotted key of a nested mapping, or :data:`MISSING`."""
    for part in dotted.split("."):
        tree = tree.get(part, MISSING) if isinstance(tree, dict) else MISSING
    return tree


def show(value: Any) -> str:
    """A value as a message quotes it: strings as they are, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value)
