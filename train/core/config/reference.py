"""The config reference, generated from the dataclasses in :mod:`train.core.config`.

``python -m train.core.config.reference --schema`` writes the JSON Schema (configs/schema.json, for
editors), ``--markdown`` the config reference (docs/config.md), ``--text`` the list that
``entrypoint.py train --help-config`` and ``python -m train --help-config`` print.
Tests keep the first two in sync. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from train.core.config import Config, types


def _json_type(tp: Any) -> dict:
    kind, args = types.shape(tp)
    if kind == "choice":
        return {"enum": list(args)}
    if kind == "union":
        return {"anyOf": [_json_type(a) for a in args]}
    if kind == "list":
        return {"type": "array", "items": _json_type(args[0])}
    if kind == "mapping":
        return {"type": "object"}
    if kind == "null":
        return {"type": "null"}
    return {"type": {int: "integer", float: "number", bool: "boolean", str: "string"}[args[0]]}


def _with_bounds(schema: dict, bounds: dict) -> dict:
    target = schema.get("items", schema)
    for arm in schema.get("anyOf", [target]):
        if arm.get("type") in ("integer", "number"):
            for key, name in (("ge", "minimum"), ("gt", "exclusiveMinimum"), ("le", "maximum")):
                if key in bounds:
                    arm[name] = bounds[key]
    return schema


def schema_for(cls: type) -> dict:
    props = {}
    for key in types.keys(cls):
        if key.section is not None:
            props[key.name] = schema_for(key.section) | {"description": key.doc}
        else:
            props[key.name] = _with_bounds(_json_type(key.type), key.bounds) | {
                "description": key.doc, "default": key.default}
    return {"type": "object", "additionalProperties": False, "properties": props}


def json_schema() -> dict:
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "train config", **schema_for(Config)}


def _type_text(tp: Any, bar: str = " \\| ") -> str:
    """The type as the tables show it; ``bar`` separates alternatives (escaped for
    Markdown by default)."""
    kind, args = types.shape(tp)
    if kind == "choice":
        return bar.join(str(a) for a in args)
    if kind == "union":
        return bar.join(_type_text(a, bar) for a in args)
    if kind == "list":
        return f"list[{_type_text(args[0], bar)}]"
    if kind == "mapping":
        return "mapping"
    return "null" if kind == "null" else args[0].__name__


def markdown() -> str:
    rows = [f"| `{dotted}` | {_type_text(key.type)} | `{json.dumps(key.default)}` | {key.doc} |"
            for dotted, key in types.leaves(Config)]
    return "\n".join(["| key | type | default | meaning |", "|---|---|---|---|", *rows]) + "\n"


_LIMITS = {"ge": ">=", "gt": ">", "le": "<="}
TEXT_HEAD = """\
Config keys: set them in the YAML file (sections as nested mappings) or on the
command line as dotted.key=value, the value read as YAML (optim.lr=3e-4
optim.betas=[0.9,0.99] data.path=null). Each key: its type (a | b: one of these),
its bounds, its default, what it does.
"""


def text(width: int = 88) -> str:
    """Every key with its type, default and meaning, section by section, for a terminal."""
    lines = [TEXT_HEAD]
    section = None
    for dotted, key in types.leaves(Config):
        head = dotted.rpartition(".")[0]
        if head != section:
            doc = next((k.doc for k in types.keys(Config) if k.name == head), "")
            lines.append(("" if section is None else "\n") + (f"{head}: {doc}" if head
                                                                else "top level:"))
            section = head
        limits = "".join(f", {_LIMITS[k]} {v}" for k, v in key.bounds.items())
        lines.append(f"  {dotted}  {_type_text(key.type, ' | ')}{limits}  "
                     f"(default {json.dumps(key.default)})")
        lines += textwrap.wrap(key.doc, width, initial_indent=" " * 6,
                               subsequent_indent=" " * 6)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--schema", action="store_true", help="print the JSON Schema")
    group.add_argument("--markdown", action="store_true", help="print the config table")
    group.add_argument("--text", action="store_true", help="print the keys as --help-config")
    args = parser.parse_args(argv)
    if args.schema:
        sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")
    elif args.text:
        sys.stdout.write(text())
    else:
        sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
