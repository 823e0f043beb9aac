"""Two more signals of code that grew a second concern, held for ``launcher/`` and
``train/``:

- no class longer than 200 lines (split it by role: the parts it holds, not a mixin);
- few catch-all handlers that swallow: an ``except Exception`` (or ``BaseException``, or
  a bare ``except``) that does not raise again hides every error of its block, the
  expected one and the bug alike. Where the errors that can occur are known, name them;
  where nothing narrower fits (user code, a thread that must keep watching, the way out
  of a process with an error), the handler says why in a comment on its line or the
  line above or below, and the count stays within :data:`MOST_SWALLOWING`.
"""

from __future__ import annotations

import ast

from tests.harness.runs import ROOT

FOLDERS = ("launcher", "train")
MOST_CLASS_LINES = 200
MOST_SWALLOWING = 15
CATCH_ALL = {"Exception", "BaseException"}


def _files():
    return [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]


def long_classes(source: str, path: str) -> list[str]:
    return [f"{path}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef)
            and node.end_lineno - node.lineno + 1 > MOST_CLASS_LINES]


def _catches_all(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in CATCH_ALL for n in names)


def swallowing(source: str, path: str) -> list[tuple[str, bool]]:
    """(where, whether a comment says why) of each catch-all handler that never raises."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ExceptHandler) and _catches_all(node) and \
                not any(isinstance(n, ast.Raise) for n in ast.walk(node)):
            said = "#" in lines[node.lineno - 1] or any(
                lines[i].strip().startswith("#") for i in (node.lineno - 2, node.lineno))
            found.append((f"{path}:{node.lineno}", said))
    return found


def test_no_class_is_over_200_lines():
    found = [hit for p in _files()
             for hit in long_classes(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert not found, "split by role:\n" + "\n".join(found)


def test_few_catch_all_handlers_swallow_and_each_says_why():
    found = [hit for p in _files()
             for hit in swallowing(p.read_text(), p.relative_to(ROOT).as_posix())]
    unexplained = [where for where, said in found if not said]
    assert not unexplained, "name the exceptions, or say why nothing narrower fits:\n" + \
        "\n".join(unexplained)
    assert len(found) <= MOST_SWALLOWING, \
        f"{len(found)} catch-all handlers swallow (at most {MOST_SWALLOWING}):\n" + \
        "\n".join(where for where, _ in found)


def test_the_checks_find_a_long_class_and_each_kind_of_catch_all():
    long = "class Big:\n" + "    x = 1\n" * MOST_CLASS_LINES
    assert long_classes(long, "t.py") == [f"t.py:1 Big: {MOST_CLASS_LINES + 1} lines"]
    assert long_classes("class Small:\n    x = 1\n", "t.py") == []
    source = ("try:\n    f()\nexcept Exception:\n    pass\n"
              "try:\n    f()\nexcept:  # the why\n    pass\n"
              "try:\n    f()\n# the why, above\nexcept (OSError, BaseException):\n    pass\n"
              "try:\n    f()\nexcept Exception:\n    raise\n"
              "try:\n    f()\nexcept OSError:\n    pass\n")
    assert swallowing(source, "t.py") == [("t.py:3", False), ("t.py:7", True),
                                          ("t.py:12", True)]
