"""The layout's rules, held by tests: who may import what.

- ``launcher/`` (the parent process: detection, planning, supervision) imports from
  ``train`` only the torch-free core, ``train.core``;
- ``train.core`` imports nothing else of ``train`` and neither torch nor numpy at
  module level; importing any core module, and ``entrypoint.py --help``, load neither;
- ``train/`` never imports ``launcher/``;
- ``launcher/`` has rooms (detection, planning, conventions, running, endings, liveness,
  commands) and at its top level only the modules of a short list; no module of it
  imports itself back through others;
- ``train/`` has rooms (:data:`ROOMS`) and a short top level (:data:`TOP_LEVEL`: the
  process entries and the user's API), both held by a list: a new module picks a room;
  nothing in a room imports a top-level module, and no module of ``train/`` imports
  itself back through others (no import circle);
- no module file name is used in two rooms (an import line or a traceback names one file).

The static checks read every import statement, including those inside functions (a
lazy import is still a dependency); the dynamic ones import for real in a fresh
interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.runs import ROOT, limit

HEAVY = ("torch", "numpy")


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, top_level_only: bool = False,
            run_time_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every import in ``path``; relative imports resolved.
    top_level_only: leave out imports inside functions and ``if TYPE_CHECKING:``;
    run_time_only: leave out those under ``if TYPE_CHECKING:`` (never executed)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if run_time_only:
        tree = _without_type_checking(tree)
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" \
        else module_name(path)
    nodes = ast.walk(tree) if not top_level_only else _top_level(tree.body)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}" if node.module is None or
                       _is_package(base) else base) for alias in node.names]
    return found


def _without_type_checking(tree: ast.Module) -> ast.Module:
    class Drop(ast.NodeTransformer):
        def visit_If(self, node: ast.If):
            return None if "TYPE_CHECKING" in ast.unparse(node.test) else \
                self.generic_visit(node)
    return Drop().visit(tree)


def _is_package(name: str) -> bool:
    return (ROOT / Path(*name.split(".")) / "__init__.py").is_file()


def _top_level(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try)):
            yield from _top_level(node.body + getattr(node, "orelse", []) +
                                  [s for h in getattr(node, "handlers", []) for s in h.body])


def violations(folder: str, allowed, *, top_level_only: bool = False) -> list[str]:
    out = []
    paths = [ROOT / folder] if folder.endswith(".py") else modules(folder)
    for path in paths:
        for line, name in imports(path, top_level_only=top_level_only):
            problem = allowed(name)
            if problem:
                out.append(f"{path.relative_to(ROOT)}:{line}: {name}: {problem}")
    return out


def launcher_rule(name: str) -> str | None:
    if (name == "train" or name.startswith("train.")) and \
            not (name == "train.core" or name.startswith("train.core.")):
        return "the launcher imports only train.core from train"
    return None


def core_rule(name: str) -> str | None:
    if name.split(".")[0] in HEAVY:
        return "the core is torch- and numpy-free at import (import it inside the function)"
    if (name.startswith("train.") and not name.startswith("train.core")) or name == "train":
        return "the core imports nothing else of train"
    if name.split(".")[0] == "launcher":
        return "the core never imports the launcher"
    return None


def train_rule(name: str) -> str | None:
    return "train never imports the launcher" if name.split(".")[0] == "launcher" else None


def test_launcher_imports_only_the_core_of_train():
    found = violations("launcher", launcher_rule)
    found += violations("entrypoint.py", launcher_rule)
    assert not found, "\n".join(found)


def test_core_imports_no_torch_numpy_or_rest_of_train():
    found = violations("train/core", lambda n: core_rule(n) if n.split(".")[0] not in HEAVY
                       else None)
    found += violations("train/core", core_rule, top_level_only=True)
    assert not found, "\n".join(found)


def test_train_never_imports_the_launcher():
    found = violations("train", train_rule)
    assert not found, "\n".join(found)


# What may live at train/'s top level, and why there: the process entries, run as
# python -m train.<name> (the launcher, docs and manifests name them), and the API the
# user's own script imports. Everything else lives in a room.
TOP_LEVEL = {
    "__init__": "the package: its version",
    "__main__": "python -m train: one training process (the loop is loop/'s)",
    "worker": "python -m train.worker: the supervised worker around __main__",
    "script": "python -m train.script: the user's script under `launch`",
    "generate": "python -m train.generate: text from an export",
    "comm_probe": "python -m train.comm_probe: doctor --comm's measurement",
    "tokenize_corpus": "python -m train.tokenize_corpus: `tokenize`'s token files",
    "runtime": "from train import runtime: the API of the user's own script (docs/your-code.md)",
}
MOST_TOP_LEVEL = 12

# The rooms of train/, each one concern (docs/architecture.md, "Layers").
ROOMS = ("checkpoint", "core", "data", "distributed", "export", "guards", "loop", "models",
         "observe")

# train/core/ (torch-free) in sub-rooms by concern; at its top, what every sub-room uses
# and the object-storage modules.
CORE_TOP_LEVEL = ("__init__", "errors", "files", "bulk")
CORE_ROOMS = ("config", "datasets", "machine", "nodes", "run", "storage", "user")

# The process entries: they may import the rooms, never the other way round.
ENTRIES = ("train", *(f"train.{m}" for m in TOP_LEVEL if m != "__init__"),
           "train.export.__main__")


def room_rule(name: str) -> str | None:
    if name in ENTRIES or any(name.startswith(e + ".") for e in ENTRIES if e != "train"):
        return "a room imports no top-level module of train (a process entry or the user's API)"
    return None


def top_level_problems(folder: Path, top=TOP_LEVEL, rooms=ROOMS) -> list[str]:
    last_train = len(folder.parts) - 1 - folder.parts[::-1].index("train")
    where = "/".join(folder.parts[last_train:])  # train or train/core
    found = [f"{where}/{p.name}: pick a room: {', '.join(rooms)} (or add it to the list of "
             f"{where}'s top level in tests/static/test_layout.py, with the reason)"
             for p in sorted(folder.glob("*.py")) if p.stem not in top]
    found += [f"{where}/{p.name}/: a new room; add it to the list of {where}'s rooms in "
              "tests/static/test_layout.py, with its concern"
              for p in sorted(folder.iterdir())
              if (p / "__init__.py").is_file() and p.name not in rooms]
    return found


def test_train_top_level_holds_only_the_listed_modules_and_rooms():
    assert len(TOP_LEVEL) <= MOST_TOP_LEVEL
    found = top_level_problems(ROOT / "train")
    assert not found, "\n".join(found)
    assert all((ROOT / "train" / f"{m}.py").is_file() for m in TOP_LEVEL), "listed but gone"


def test_train_core_top_level_holds_only_the_listed_modules_and_sub_rooms():
    found = top_level_problems(ROOT / "train" / "core", CORE_TOP_LEVEL, CORE_ROOMS)
    assert not found, "\n".join(found)
    assert all((ROOT / "train" / "core" / f"{m}.py").is_file() for m in CORE_TOP_LEVEL)


def test_no_room_imports_a_top_level_module():
    rooms = [p for p in (ROOT / "train").iterdir() if (p / "__init__.py").is_file()]
    assert {p.name for p in rooms} == set(ROOMS)
    found = [v for room in rooms for v in violations(f"train/{room.name}", room_rule)]
    assert not found, "\n".join(found)


def twins(folder: Path) -> dict[str, list[str]]:
    """Module file names used in more than one folder of ``folder`` (its rooms, their
    sub-rooms and its top level), with the folders."""
    where: dict[str, list[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        if path.stem not in ("__init__", "__main__"):
            where.setdefault(path.stem, []).append(str(path.parent.relative_to(folder.parent)))
    return {name: dirs for name, dirs in where.items() if len(dirs) > 1}


def test_no_module_file_name_in_two_rooms():
    found = twins(ROOT / "train")
    assert not found, "rename by what each does:\n" + "\n".join(
        f"{name}.py in {', '.join(dirs)}" for name, dirs in found.items())


def import_graph(folder: str = "train") -> dict[str, set[str]]:
    """module -> the modules of ``folder`` it imports (lazy imports included)."""
    names = {module_name(p) for p in modules(folder)}
    graph = {}
    for path in modules(folder):
        found = set()
        for _, name in imports(path, run_time_only=True):
            while name and name not in names:  # train.core.run.rundir.LATEST -> ...rundir
                name = name.rpartition(".")[0]
            if name and name != module_name(path):
                found.add(name)
        graph[module_name(path)] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once (depth-first search, grey/black marking)."""
    state, stack, found = {}, [], []

    def visit(node: str) -> None:
        state[node] = "grey"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "grey":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "black"
    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_train_has_no_import_circle():
    # a package's __init__ re-exporting its own modules is not a circle of the code
    graph = {m: {n for n in deps if not (m.startswith(n + ".") and n != "train")}
             for m, deps in import_graph().items()}
    graph = {m: {n for n in deps if n != "train"} for m, deps in graph.items()}
    found = circles(graph)
    assert not found, "\n".join(" -> ".join(c) for c in found)


def test_launcher_has_no_import_circle():
    graph = {m: {n for n in deps if not (m.startswith(n + ".") and n != "launcher")}
             for m, deps in import_graph("launcher").items()}
    found = circles(graph)
    assert not found, "\n".join(" -> ".join(c) for c in found)


# launcher/'s top level: the command line (entrypoint.py imports launcher.cli) and
# torchrun's agent (run as python -m launcher.torchrun, a name plans, docs and process
# lists show). Everything else lives in a room by concern.
LAUNCHER_TOP = ("__init__", "cli", "torchrun")
LAUNCHER_ROOMS = ("commands", "conventions", "detection", "endings", "liveness", "planning",
                  "running")


def launcher_top_level(root: Path) -> tuple[list[str], list[str]]:
    """(modules, packages) directly in ``root``/launcher."""
    folder = root / "launcher"
    return (sorted(p.stem for p in folder.glob("*.py")),
            sorted(p.name for p in folder.iterdir() if (p / "__init__.py").is_file()))


def launcher_layout_problems(root: Path) -> list[str]:
    mods, rooms = launcher_top_level(root)
    problems = [f"launcher/{m}.py: a new module at launcher/'s top level; pick a room "
                f"({', '.join(LAUNCHER_ROOMS)}) by what it does" for m in mods
                if m not in LAUNCHER_TOP]
    problems += [f"launcher/{r}/: a new room; add it to LAUNCHER_ROOMS if it is one concern"
                 for r in rooms if r not in LAUNCHER_ROOMS]
    return problems


def test_launcher_top_level_holds_only_its_list_and_rooms():
    assert not launcher_layout_problems(ROOT), "\n".join(launcher_layout_problems(ROOT))
    assert set(launcher_top_level(ROOT)[1]) == set(LAUNCHER_ROOMS)


def launcher_room_rule(name: str) -> str | None:
    return "a room imports no process entry (python -m launcher.torchrun)" \
        if name == "launcher.torchrun" else None


def test_no_launcher_room_imports_a_process_entry():
    found = [v for room in LAUNCHER_ROOMS
             for v in violations(f"launcher/{room}", launcher_room_rule)]
    assert not found, "\n".join(found)


def test_a_new_launcher_module_is_told_to_pick_a_room(tmp_path):
    (tmp_path / "launcher" / "detection").mkdir(parents=True)
    (tmp_path / "launcher" / "detection" / "__init__.py").write_text("")
    for name in (*LAUNCHER_TOP, "gossip"):
        (tmp_path / "launcher" / f"{name}.py").write_text("")
    assert launcher_layout_problems(tmp_path) == [
        "launcher/gossip.py: a new module at launcher/'s top level; pick a room "
        f"({', '.join(LAUNCHER_ROOMS)}) by what it does"]


def test_a_circle_and_a_room_importing_an_entry_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert room_rule("train.worker") and room_rule("train.__main__")
    assert room_rule("train.runtime.init") and room_rule("train.export.__main__")
    assert room_rule("train.checkpoint.state") is None and room_rule("train.export") is None
    assert room_rule("train.__version__") is None


def test_a_new_top_level_module_and_a_twin_are_found(tmp_path):
    (tmp_path / "train" / "rooma").mkdir(parents=True)
    (tmp_path / "train" / "roomb" / "sub").mkdir(parents=True)
    for name in ("train/worker.py", "train/helpers.py", "train/rooma/__init__.py",
                 "train/rooma/io.py", "train/roomb/sub/io.py", "train/roomb/__init__.py"):
        (tmp_path / name).write_text("")
    found = top_level_problems(tmp_path / "train")
    assert found[0].startswith("train/helpers.py: pick a room: ") and len(found) == 3
    assert twins(tmp_path / "train") == {"io": ["train/rooma", "train/roomb/sub"]}


def test_the_rules_catch_a_violation(tmp_path, monkeypatch):
    """A deliberate breach of each rule is found (the checks above can fail)."""
    fake = tmp_path / "launcher" / "bad.py"
    fake.parent.mkdir()
    fake.write_text("def f():\n    from train import trainer\n    import train.checkpoint\n")
    core = tmp_path / "train" / "core" / "bad.py"
    core.parent.mkdir(parents=True)
    core.write_text("import numpy as np\nfrom train.models import GPT\n"
                    "def g():\n    import torch\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert len(violations("launcher", launcher_rule)) == 2
    core_found = violations("train/core", core_rule, top_level_only=True)
    assert [v.split(": ")[1] for v in core_found] == ["numpy", "train.models"]


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(m for m in "
         "sys.modules if m.split('.')[0] in ('torch', 'numpy'))))"],
        cwd=ROOT, capture_output=True, text=True, timeout=limit(120))
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_importing_the_core_and_launcher_loads_neither_torch_nor_numpy():
    names = [module_name(p) for p in modules("train/core") + modules("launcher")
             if p.name != "__main__.py"]
    assert "train.core.config" in names and "launcher.planning.plan" in names
    code = "import importlib\n" + "".join(f"importlib.import_module({n!r})\n" for n in names)
    assert _loaded_after(code) == set()


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["train", "--help-config"]])
def test_help_loads_neither_torch_nor_numpy(args):
    code = (f"import sys; sys.argv = ['entrypoint.py', *{args!r}]\n"
            "import contextlib, io\nfrom launcher.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): main()")
    assert _loaded_after(code) == set()


def test_planning_a_run_without_gpus_does_not_import_torch(tmp_path):
    """``import torch`` is about 2 s of a launch; without GPUs the parent reads the
    build from torch's files (the workers import it anyway)."""
    config = ROOT / "configs" / "quickstart.yaml"
    code = (f"import sys; sys.argv = ['entrypoint.py', 'train', {str(config)!r}, "
            f"'output.dir={tmp_path}', '--dry-run']\n"
            "import contextlib, io\nfrom launcher.running import runner\n"
            "from launcher.detection.hardware import Hardware\n"
            "runner.detect = lambda env: Hardware(cpus=2)  # a machine without GPUs\n"
            "from launcher.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): assert main() == 0")
    assert "torch" not in {m.split(".")[0] for m in _loaded_after(code)}


def test_the_build_read_from_torchs_files_is_what_torch_says():
    from launcher.detection.detect import torch_build, torch_build_on_disk
    light, full = torch_build_on_disk(), torch_build()
    assert light is not None
    for field in ("version", "cuda", "hip", "gloo", "nccl", "importable"):
        assert getattr(light, field) == getattr(full, field), field


MOST_LINES = 350  # a module longer than this has usually grown a second concern


def test_no_module_of_the_launcher_or_the_trainer_is_over_350_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in modules("launcher") + modules("train")
            if (n := len(p.read_text().splitlines())) > MOST_LINES]
    assert not long, "split by concern:\n" + "\n".join(long)


def test_no_bench_module_hides_a_standard_library_module():
    """bench/plain_ddp.py runs as a script, so bench/ comes first on its sys.path: a
    bench/tokenize.py once replaced Python's tokenize there, and torch's tracebacks failed."""
    names = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert not names & set(sys.stdlib_module_names)


PROJECT = ("train", "launcher", "tools", "bench", "tests")


def unresolved(name: str) -> str | None:
    """Why ``name`` (a module, or a name imported from a package) is not in the
    repository; None when it is."""
    path = ROOT / Path(*name.split("."))
    if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
        return None
    package, _, attribute = name.rpartition(".")
    init = ROOT / Path(*package.split(".")) / "__init__.py"
    if init.is_file() and attribute in _bound_names(init):
        return None  # a name the package's __init__ defines or imports
    return "no such module in the repository"


def _bound_names(path: Path) -> set[str]:
    """The names a module's top level binds: definitions, assignments, imports."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def test_every_import_of_the_projects_own_modules_names_one_that_exists():
    """A module moved to another room leaves no import behind, lazy ones included (those
    only fail when their line runs: in a worker, mid-run)."""
    found = []
    for folder in PROJECT:
        for path in modules(folder):
            for line, name in imports(path):
                if name.split(".")[0] in PROJECT and (problem := unresolved(name)):
                    found.append(f"{path.relative_to(ROOT)}:{line}: {name}: {problem}")
    found += violations("entrypoint.py", lambda n: unresolved(n)
                        if n.split(".")[0] in PROJECT else None)
    assert not found, "\n".join(found)


def test_an_import_of_a_moved_module_is_found(tmp_path, monkeypatch):
    (tmp_path / "train" / "core" / "run").mkdir(parents=True)
    for init in ("train", "train/core", "train/core/run"):
        (tmp_path / init / "__init__.py").write_text("")
    (tmp_path / "train" / "core" / "run" / "rundir.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert unresolved("train.core.run.rundir") is None
    assert unresolved("train.core.rundir") == "no such module in the repository"
