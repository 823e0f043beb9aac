"""The config reference, generated from the dataclasses in :mod:`train.config`.

``python -m train.reference --schema`` writes the JSON Schema (configs/schema.json, for
editors), ``--markdown`` the README's config table. Tests keep both in sync.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from typing import Any, Literal

from train.config import Config, field_types, _is_dataclass_type


def _json_type(tp: Any) -> dict:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_json_type(a) for a in typing.get_args(tp)]}
    if origin is list:
        return {"type": "array", "items": _json_type(typing.get_args(tp)[0])}
    if tp is type(None):
        return {"type": "null"}
    return {"type": {int: "integer", float: "number", bool: "boolean", str: "string"}[tp]}


def _bounds(schema: dict, meta: Any) -> dict:
    target = schema.get("items", schema)
    for arm in schema.get("anyOf", [target]):
        if arm.get("type") in ("integer", "number"):
            for key, name in (("ge", "minimum"), ("gt", "exclusiveMinimum"), ("le", "maximum")):
                if meta.get(key) is not None:
                    arm[name] = meta[key]
    return schema


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    value = f.default_factory()
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def schema_for(cls: type) -> dict:
    props = {}
    types_ = field_types(cls)
    for f in dataclasses.fields(cls):
        tp = types_[f.name]
        if _is_dataclass_type(tp):
            props[f.name] = schema_for(tp) | {"description": f.metadata["doc"]}
        else:
            props[f.name] = _bounds(_json_type(tp), f.metadata) | {
                "description": f.metadata["doc"], "default": _default(f)}
    return {"type": "object", "additionalProperties": False, "properties": props}


def json_schema() -> dict:
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "train config", **schema_for(Config)}


def _type_text(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " \\| ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_text(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_text(typing.get_args(tp)[0])}]"
    return "null" if tp is type(None) else tp.__name__


def markdown_rows(cls: type = Config, prefix: str = "") -> list[str]:
    rows = []
    types_ = field_types(cls)
    for f in dataclasses.fields(cls):
        tp = types_[f.name]
        if _is_dataclass_type(tp):
            rows += markdown_rows(tp, f"{prefix}{f.name}.")
            continue
        default = json.dumps(_default(f))
        rows.append(f"| `{prefix}{f.name}` | {_type_text(tp)} | `{default}` | "
                    f"{f.metadata['doc']} |")
    return rows


def markdown() -> str:
    return "\n".join(["| key | type | default | meaning |", "|---|---|---|---|",
                      *markdown_rows()]) + "\n"


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
