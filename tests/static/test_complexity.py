"""No function in ``launcher/`` or ``train/`` is more complex than radon's grade C: a
cyclomatic complexity over 20 (``radon cc -s -n D launcher train`` lists them) is a
chain of decisions to split into helpers whose names say what each part decides.
"""

from __future__ import annotations

from radon.complexity import cc_visit

from tests.harness.runs import ROOT

FOLDERS = ("launcher", "train")
MOST = 20  # radon's grade C ends here


def over_limit(source: str, path: str) -> list[tuple[str, int, str, int]]:
    """(path, line, name, complexity) of each function, method or closure over MOST."""
    found, blocks = [], cc_visit(source)
    while blocks:
        block = blocks.pop()
        blocks += getattr(block, "closures", [])  # radon leaves them out of their parent's
        if block.complexity > MOST:
            found.append((path, block.lineno, block.fullname, block.complexity))
    return sorted(found)


def test_no_function_in_launcher_or_train_is_over_the_limit():
    found = [hit for folder in FOLDERS for file in sorted((ROOT / folder).rglob("*.py"))
             for hit in over_limit(file.read_text(), file.relative_to(ROOT).as_posix())]
    too_complex = [f"{path}:{line} {name} {cc}" for path, line, name, cc in found]
    assert not too_complex, f"over complexity {MOST}; split into helpers:\n" + \
        "\n".join(too_complex)


def _branches(name: str, complexity: int, indent: str = "") -> str:
    """A function of that complexity: one path, plus one per if."""
    ifs = "".join(f"{indent}    if x == {i}:\n{indent}        x += 1\n"
                  for i in range(complexity - 1))
    return f"{indent}def {name}(x):\n{ifs}{indent}    return x\n"


def test_the_check_reports_each_function_over_the_limit_and_only_those():
    source = _branches("at_the_limit", MOST) + _branches("tangled", MOST + 1) + \
        "def outer():\n" + _branches("nested", MOST + 1, indent="    ")
    lines = source.splitlines()
    assert over_limit(source, "t.py") == [
        ("t.py", lines.index("def tangled(x):") + 1, "tangled", MOST + 1),
        ("t.py", lines.index("    def nested(x):") + 1, "nested", MOST + 1)]
