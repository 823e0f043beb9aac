"""The run directory's names have one owner (train/core/run/rundir.py): no product module
spells one itself, and docs/training.md's table lists exactly the layout it defines."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from tests.harness.runs import ROOT
from train.core.run import rundir

PRODUCT = ("train", "launcher", "tools")
OWNER = ROOT / "train" / "core" / "run" / "rundir.py"
# Names distinctive anywhere: spelled as a string in product code, they are a second owner.
FILE_NAMES = (rundir.CONFIG, rundir.MANIFEST, rundir.METRICS, rundir.RESULT, rundir.TRACKERS,
              rundir.DIVERGED, rundir.PREFLIGHT, rundir.LOCK, rundir.FLOCK, rundir.STATE_FILE,
              rundir.CHECKSUMS, rundir.EXPORT_WEIGHTS, rundir.EXPORT_META)
# Plain words that mean a run-directory path only where a path is built from them.
FOLDER_NAMES = (rundir.BOARD, rundir.LOGS, rundir.EXPORT, rundir.CHECKPOINTS, rundir.LATEST,
                rundir.SHARDS, rundir.WANDB)


def product_files() -> list[Path]:
    files = [p for folder in PRODUCT for p in (ROOT / folder).rglob("*.py")]
    return [p for p in files + [ROOT / "entrypoint.py"] if p != OWNER]


def _path_parts(tree: ast.AST):
    """String constants a path is built from: ``x / "name"``, ``Path("name")``,
    ``.joinpath("name")``, ``os.path.join(..., "name")``, ``f"step-{n}"`` fragments."""
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            yield from (n for n in (node.left, node.right) if isinstance(n, ast.Constant))
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.endswith(("Path", "joinpath", "path.join", "with_name")):
                yield from (a for a in node.args if isinstance(a, ast.Constant))


def stray_names(path: Path) -> list[str]:
    text = path.read_text()
    tree = ast.parse(text)
    suffixes = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                for part in node.values if str(getattr(part, "value", "")).startswith(".")}
    found = [f"{node.lineno}: {node.value!r}" for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and node.value in FILE_NAMES and
             id(node) not in suffixes]  # f"{name}.lock": a suffix, not the lease
    found += [f"{node.lineno}: {node.value!r} in a path" for node in _path_parts(tree)
              if node.value in FOLDER_NAMES]
    found += [f"{text[:m.start()].count(chr(10)) + 1}: {m.group(0)!r}"
              for m in re.finditer(r'f"step-\{|f"rank-\{[^}]*\}\.pt"', text)]
    return [f"{path.relative_to(ROOT)}:{line}" for line in found]


def test_no_product_module_spells_a_run_directory_name():
    found = [line for path in product_files() for line in stray_names(path)]
    assert not found, "use train.core.run.rundir's names:\n" + "\n".join(found)


def test_the_check_finds_a_stray_name(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text('from pathlib import Path\n'
                   'def f(run):\n    return run / "result.json", run / "checkpoints" / "x"\n'
                   'def g(run, n):\n    return Path("tb"), run / f"step-{n}", "tb"\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert sorted(line.split(":")[1] for line in stray_names(bad)) == ["3", "3", "5", "5"]


def documented_layout() -> list[str]:
    """The first column of docs/training.md's run-directory table."""
    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split("## The run directory", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])]


def test_the_documented_run_directory_is_the_layout_the_code_defines():
    assert documented_layout() == list(rundir.LAYOUT)
