"""One walker over the schema's dataclasses and the few field types they use.

The loader (checking and converting values), the JSON Schema and docs/config.md
(:mod:`train.core.config.reference`) all read the schema through these functions, so a new field
type is taught here once.

Field types: ``int``, ``float``, ``bool``, ``str``, ``None``, ``Literal[...]``,
``list[T]``, ``dict[str, Any]`` (free keyword arguments for the user's own code),
unions of those (``int | Literal["auto"]``), and a nested dataclass (a config section).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

SCALARS = (int, float, bool, str)


@dataclass(frozen=True)
class Key:
    """One field of a config section."""
    name: str
    type: Any
    doc: str
    bounds: dict[str, float]          # ge / gt / le, those that are set
    default: Any                      # a plain value; a section's defaults as a dict
    section: type | None = None       # the dataclass, when the key holds a section


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    value = f.default_factory()
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def keys(cls: type) -> list[Key]:
    """The fields of one section, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        bounds = {k: f.metadata[k] for k in ("ge", "gt", "le") if f.metadata.get(k) is not None}
        out.append(Key(f.name, tp, f.metadata["doc"], bounds, _default(f),
                       tp if is_section(tp) else None))
    return out


def leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, Key]]:
    """Every value key below ``cls`` with its dotted name, sections expanded in place."""
    for key in keys(cls):
        if key.section is not None:
            yield from leaves(key.section, f"{prefix}{key.name}.")
        else:
            yield prefix + key.name, key


def shape(tp: Any) -> tuple[str, tuple]:
    """What a field type is: ("choice", values), ("union", arms), ("list", (item,)),
    ("mapping", ()), ("null", ()) or ("scalar", (int | float | bool | str,))."""
    origin = typing.get_origin(tp)
    if origin is dict:
        return "mapping", ()
    if origin is Literal:
        return "choice", typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return "union", typing.get_args(tp)
    if origin is list:
        return "list", typing.get_args(tp)
    if tp is type(None):
        return "null", ()
    if tp in SCALARS:
        return "scalar", (tp,)
    raise TypeError(f"unsupported config type {tp!r}")


_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def describe(tp: Any) -> str:
    """What an error message says is allowed: "one of a, b", "an integer or null"."""
    kind, args = shape(tp)
    if kind == "choice":
        return "one of " + ", ".join(str(a) for a in args)
    if kind == "union":
        return " or ".join(describe(a) for a in args)
    if kind == "list":
        return f"a list of {describe(args[0])}"
    if kind == "mapping":
        return "a mapping of names to values"
    if kind == "null":
        return "null"
    return _WORDS[args[0]]


def closest_choice(value: Any, tp: Any) -> str | None:
    """The allowed word nearest a misspelt one (``crossentropy`` for ``cross_entropy``),
    among the choices ``tp`` allows; None when nothing is near or ``value`` is no word."""
    kind, args = shape(tp)
    if not isinstance(value, str):
        return None
    if kind == "choice":
        words = [str(a) for a in args]
    elif kind == "union":
        words = [str(a) for arm in args if shape(arm)[0] == "choice" for a in shape(arm)[1]]
    else:
        return None
    close = difflib.get_close_matches(value.lower(), words, n=1, cutoff=0.7)
    return close[0] if close else None


NO = object()  # coerce's "does not fit"


def coerce(value: Any, tp: Any, from_cli: bool) -> Any:
    """``value`` converted to ``tp``, or :data:`NO` when it does not fit.

    from_cli: the value came from a ``key=value`` override, where ``run.name=2024``
    arrives as a number but a string is meant.
    """
    kind, args = shape(tp)
    if kind == "choice":
        if value is False and "off" in args:  # YAML 1.1 reads a bare `off` as false
            return "off"
        return value if value in args else NO
    if kind == "union":
        for arm in args:
            got = coerce(value, arm, from_cli)
            if got is not NO:
                return got
        return NO
    if kind == "list":
        if not isinstance(value, list):
            return NO
        items = [coerce(v, args[0], from_cli) for v in value]
        return NO if any(i is NO for i in items) else items
    if kind == "mapping":
        if value is None:
            return {}
        ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
        return dict(value) if ok else NO
    if kind == "null":
        return None if value is None else NO
    return _coerce_scalar(value, args[0], from_cli)


def _coerce_scalar(value: Any, tp: type, from_cli: bool) -> Any:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is bool:
        return value if isinstance(value, bool) else NO
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else NO
    if tp is float:
        if number:
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                return NO
        return NO
    if isinstance(value, str):
        return value
    return str(value) if from_cli and number else NO


def bounds_problem(value: Any, bounds: dict[str, float]) -> str | None:
    """What is wrong with a number (or each number of a list): not finite, or out of bounds."""
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if not math.isfinite(v):
            return "must be a finite number"
        if "ge" in bounds and v < bounds["ge"]:
            return f"must be >= {bounds['ge']}"
        if "gt" in bounds and v <= bounds["gt"]:
            return f"must be > {bounds['gt']}"
        if "le" in bounds and v > bounds["le"]:
            return f"must be <= {bounds['le']}"
    return None
