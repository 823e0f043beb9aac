"""The config reference, generated from the dataclasses in :mod:`train.config`.

``python -m train.reference --schema`` writes the JSON Schema (configs/schema.json, for
editors), ``--markdown`` the README's config table. Tests keep both in sync.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from train.config import Config
from train.config import types


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


def _type_text(tp: Any) -> str:
    kind, args = types.shape(tp)
    if kind == "choice":
        return " \\| ".join(str(a) for a in args)
    if kind == "union":
        return " \\| ".join(_type_text(a) for a in args)
    if kind == "list":
        return f"list[{_type_text(args[0])}]"
    if kind == "mapping":
        return "mapping"
    return "null" if kind == "null" else args[0].__name__


def markdown() -> str:
    rows = [f"| `{dotted}` | {_type_text(key.type)} | `{json.dumps(key.default)}` | {key.doc} |"
            for dotted, key in types.leaves(Config)]
    return "\n".join(["| key | type | default | meaning |", "|---|---|---|---|", *rows]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--schema", action="store_true", help="print the JSON Schema")
    group.add_argument("--markdown", action="store_true", help="print the config table")
    args = parser.parse_args(argv)
    if args.schema:
        sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")
    else:
        sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
