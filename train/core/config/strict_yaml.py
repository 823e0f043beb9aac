"""``yaml.safe_load`` with the limits a config file needs, each failure one line.

A config is a few kilobytes of nested keys. Anything far from that is a mistake or an
attack, and must end as a one-line error in well under a second, not as a hang, a
RecursionError or a message of megabytes:

- size: at most :data:`MAX_BYTES` (a 50 MB file otherwise takes minutes and GBs);
- depth: at most :data:`MAX_DEPTH` levels of nesting (deeper input overflows the
  parser's recursion);
- expanded size: at most :data:`MAX_VALUES` values once aliases are followed (a few
  hundred bytes of nested ``&a``/``*a`` aliases can stand for billions of values);
- duplicate keys: YAML lets the last one win silently; here they are an error naming
  both lines.

Only ``yaml.SafeLoader``'s types are built (no Python objects, ever).
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_VALUES = 100_000


class StrictYamlError(ValueError):
    """What is wrong, and where (a key, "line N" or "<file>")."""

    def __init__(self, where: str, problem: str):
        super().__init__(problem)
        self.where, self.problem = where, problem


class _Loader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        if self._depth > MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise StrictYamlError(f"line {mark.line + 1}",
                                  f"nested deeper than {MAX_DEPTH} levels")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults`: explicit keys may override merged ones
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.setdefault(key, line)
            except TypeError:  # an unhashable key; PyYAML reports it below
                continue
            if first != line:
                raise StrictYamlError(clip(key), f"appears twice (lines {first} and {line}); "
                                                  "keep one")
        return super().construct_mapping(node, deep=deep)


def short(value: Any, limit: int = 60) -> str:
    """repr() cut to ``limit`` characters, for messages that must stay one short line."""
    return clip(repr(value), limit)


def clip(text: str, limit: int = 60) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _count(value: Any, budget: int) -> int:
    """Values in ``value`` with aliases expanded, stopping once over ``budget``."""
    stack, seen = [value], 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > budget:
            return seen
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return seen


def load(text: str) -> Any:
    """Parse YAML text under the limits above; StrictYamlError otherwise."""
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_BYTES:
        raise StrictYamlError("<file>", f"{size / 2**20:.1f} MiB; a config is at most "
                                        f"{MAX_BYTES >> 20} MiB")
    try:
        loader = _Loader(text)
    except yaml.reader.ReaderError as exc:  # a control character: YAML refuses to read on
        line = text.count("\n", 0, exc.position) + 1
        raise StrictYamlError(f"line {line}", f"invalid YAML: a control character (#x"
                                             f"{exc.character:02x}); YAML holds printable "
                                             "text only") from None
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}" if mark else "<file>"
        raise StrictYamlError(where, f"invalid YAML: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise StrictYamlError("<file>", f"invalid YAML: {exc}") from None
    except RecursionError:
        raise StrictYamlError("<file>", "nested too deeply") from None
    finally:
        loader.dispose()
    if _count(data, MAX_VALUES) > MAX_VALUES:
        raise StrictYamlError("<file>", f"expands to more than {MAX_VALUES} values (aliases "
                                        "that refer to aliases?)")
    return data
