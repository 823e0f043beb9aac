"""The launcher's check of the user's code by reading it (train/core/user/usersource.py):
real files in a temporary project folder; the property is that nothing of that code
runs (a module whose import would leave a file or raise), while a path that cannot be
found, a name the module does not define and arguments its signature refuses are one
ConfigError each, and what the source cannot show is left to the workers."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from train.core.errors import ConfigError
from train.core.user import usersource

# Importing this module would leave a file beside it, then fail.
SIDE_EFFECT = """
from pathlib import Path
Path(__file__).with_name("ran").touch()
raise RuntimeError("executed")
"""


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(folder: Path, name: str, text: str) -> None:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def error(path: str, args: dict | None = None) -> str | None:
    try:
        usersource.check_path(path, "model.factory", "c.yaml", args, "model.args")
    except ConfigError as exc:
        return exc.one_line()
    return None


def test_a_function_is_found_and_its_arguments_checked_without_running_the_module(project):
    write(project, "uc_nets.py", SIDE_EFFECT + "\ndef build(inputs: int, width: int = 64):\n"
                                               "    pass\n")
    assert error("uc_nets:build", {"inputs": 3}) is None
    assert error("uc_nets.build", {"inputs": 3, "width": 2}) is None
    assert error("uc_nets:build", {"inputs": 3, "heigth": 2}) == (
        "error: c.yaml: model.args: got an unexpected keyword argument 'heigth'; the "
        "factory's parameters are (inputs: int, width: int = 64)")
    assert "missing a required argument: 'inputs'" in error("uc_nets:build", {})
    assert not (project / "ran").exists()


def test_a_name_the_module_does_not_define_is_named_with_its_file(project):
    write(project, "uc_none.py", "def build():\n    pass\n")
    assert error("uc_none:make", {}) == (
        f"error: c.yaml: model.factory: uc_none has no 'make' ({project / 'uc_none.py'})")


def test_a_missing_module_and_a_syntax_error_are_the_imports_errors(project):
    assert "cannot import nowhere_at_all (from " in error("nowhere_at_all:build")
    assert "No module named 'nowhere_at_all'" in error("nowhere_at_all:build")
    write(project, "uc_syntax.py", "def build(:\n")
    assert error("uc_syntax:build").startswith(
        "error: c.yaml: model.factory: cannot import uc_syntax: SyntaxError: ")
    assert "uc_syntax.py, line 1" in error("uc_syntax:build")
    assert "expected an import path" in error("build")


def test_a_class_takes_its_own_init_without_self(project):
    write(project, "uc_cls.py", """
        import torch
        class Net(torch.nn.Module):
            def __init__(self, width, *, depth=2):
                super().__init__()
        """)
    assert error("uc_cls:Net", {"width": 1, "depth": 3}) is None
    assert "got an unexpected keyword argument 'self'" in error("uc_cls:Net", {"self": 1,
                                                                               "width": 1})


def test_a_submodule_is_found_without_running_its_package(project):
    write(project, "uc_pkg/__init__.py", SIDE_EFFECT)
    write(project, "uc_pkg/models/__init__.py", SIDE_EFFECT)
    write(project, "uc_pkg/models/gpt.py", "def build(n):\n    pass\n")
    assert error("uc_pkg.models.gpt:build", {"n": 1}) is None
    assert "got an unexpected keyword argument 'm'" in error("uc_pkg.models.gpt:build",
                                                             {"n": 1, "m": 1})
    assert "uc_pkg.models has no 'gpt'" not in (error("uc_pkg.models.gpt:nothing") or "")
    assert "uc_pkg.models.gpt has no 'nothing'" in error("uc_pkg.models.gpt:nothing")
    assert not (project / "uc_pkg" / "ran").exists()


@pytest.mark.parametrize("source", [
    "from elsewhere import build\n",                                  # imported: defined
    "try:\n    from a import build\nexcept ImportError:\n    def build(x): pass\n",  # twice
    "if True:\n    build = lambda: None\n",                           # an assignment
    "import functools\n@functools.cache\ndef build(): pass\n",        # decorated: may change
    "from elsewhere import *\n",                                      # a star import
    "def __getattr__(name):\n    return print\n",                     # a module __getattr__
    "import dataclasses\n@dataclasses.dataclass\nclass build:\n    x: int = 1\n",
    "class Base:\n    def __init__(self): pass\nclass build(Base):\n    pass\n",  # inherited
])
def test_what_the_source_cannot_show_is_left_to_the_workers(project, source):
    write(project, "uc_dyn.py", source)
    assert error("uc_dyn:build", {"anything": 1}) is None


def test_installed_and_compiled_modules(project):
    # the standard library's source, read as a user's
    assert error("json.encoder:JSONEncoder", {"indent": 2}) is None
    assert "got an unexpected keyword argument 'nope'" in error("json.encoder:JSONEncoder",
                                                                {"nope": 2})
    assert error("math:sqrt", {"anything": 1}) is None            # built in: no source to read
