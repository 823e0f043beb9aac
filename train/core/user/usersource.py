"""The launcher's check of the user's code, by reading it: nothing of it is executed.

A factory module may import heavy packages (``transformers`` takes seconds, minutes on a
loaded machine) and every worker imports it anyway, so the launcher (``train``, ``train
--dry-run``, ``doctor CONFIG``) does not: it finds each import path's file as Python's
import would (``importlib`` finders: the working directory, then installed packages,
editable installs included), parses it (:mod:`ast`), and checks that the name is defined
there and, where its signature can be read from the source, that the config's ``args``
fit it. What only running the code can tell (the factory raising, a dataset without
(input, target) pairs, a model and loss that do not fit) the workers find before step 1:
the same one line and exit 2 (:mod:`train.core.user.usercode`, :mod:`train.models.losses`), and no
restart repeats it.

Where the source cannot say for sure (a compiled module, a name made by a decorator, a
star import, a module ``__getattr__``, an inherited ``__init__``), nothing is reported
here and the workers decide: this check never refuses code that would have run.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import inspect
import os
import sys
from pathlib import Path

from train.core.errors import ConfigError

UNKNOWN = None  # the source cannot tell: left to the workers
# Source that may define module names no assignment shows.
_DYNAMIC = ("import *", "__getattr__", "globals()", "exec(", "setattr(")


class _Text(str):
    """A default or an annotation as written in the source: shown as such in a signature."""

    def __repr__(self) -> str:
        return str(self)


def split_path(path: str, key: str, source: str) -> tuple[str, str]:
    """``package.module:name`` (or ``package.module.name``) -> (module, name)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(source, key, f"got {path!r}; expected an import path like "
                                       "'package.module:name'")
    return module_name, attr


def find_source(module_name: str, key: str, source: str) -> Path | None:
    """The module's .py file (a package's ``__init__.py``), found without importing it or
    its packages; None when it has no source to read (compiled, built in, namespace).
    ConfigError when no finder knows it."""
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)  # where the workers look first
    importlib.invalidate_caches()  # a file written since the finders last listed its folder
    try:
        spec = _find_spec(module_name)
    except (ImportError, ValueError) as exc:
        spec, error = None, f"{type(exc).__name__}: {exc}"
    else:
        error = f"ModuleNotFoundError: No module named {module_name!r}"
    finally:
        if added:
            sys.path.remove(here)
    if spec is None:
        raise ConfigError(source, key, f"cannot import {module_name} (from {here} or "
                                       f"installed packages): {error}")
    origin = spec.origin if spec.has_location else None
    return Path(origin) if origin and origin.endswith(".py") else None


def _find_spec(module_name: str):
    """The top-level name through every finder (importing nothing); each submodule by
    its package's search locations, so no package's ``__init__`` runs."""
    parts = module_name.split(".")
    spec = importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]),
                                                        list(spec.submodule_search_locations))
    return spec


def parse(path: Path, module_name: str, key: str, source: str) -> ast.Module:
    """The module's syntax tree; a syntax error is the import's error, one line."""
    try:
        return ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:
        raise ConfigError(source, key, f"cannot import {module_name}: SyntaxError: {exc.msg} "
                                       f"({path.name}, line {exc.lineno})") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(source, key, f"cannot read {path}: {exc}") from None


def _names(body: list[ast.stmt]) -> dict[str, ast.AST | None]:
    """Module-level names -> their def or class (None: defined, signature unknown),
    including those defined under if/try/with/for."""
    out: dict[str, ast.AST | None] = {}

    def define(name: str, node: ast.AST | None) -> None:
        out[name] = node if name not in out else None  # defined twice: which one holds?

    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            define(node.name, node)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                define((a.asname or a.name).split(".")[0], None)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for n in (n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                define(n.id, None)
        for inner in _blocks(node):
            for name, found in _names(inner).items():
                define(name, found)
    return out


def _blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists nested in a compound statement (if, try, with, for, while)."""
    blocks = [getattr(node, f) for f in ("body", "orelse", "finalbody")
              if isinstance(getattr(node, f, None), list)]
    return blocks + [h.body for h in getattr(node, "handlers", [])]


def lookup(tree: ast.Module, text: str, attr: str) -> ast.AST | bool | None:
    """What ``attr`` names in the module: its def or class, UNKNOWN (defined, or maybe
    defined, in a way the source cannot show), or False (certainly not defined)."""
    names = _names(tree.body)
    first, *rest = attr.split(".")
    if first not in names:
        return UNKNOWN if any(sign in text for sign in _DYNAMIC) else False
    node = names[first]
    for part in rest:  # Class.method: look in the class body, else cannot say
        if not isinstance(node, ast.ClassDef):
            return UNKNOWN
        node = _names(node.body).get(part)
    return node


def signature(node: ast.AST | None) -> inspect.Signature | None:
    """The signature the source shows for a plain function or a class's own ``__init__``
    (without ``self``); None when decorators, a metaclass or a base class may change it."""
    drop_self = False
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef)
                     and n.name == "__init__"), None)
        if node.decorator_list or node.keywords or init is None or \
                any(isinstance(n, ast.FunctionDef) and n.name == "__new__" for n in node.body):
            return None
        node, drop_self = init, True
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
        return None
    params = _parameters(node.args)
    return inspect.Signature(params[1:] if drop_self else params)


def _parameters(a: ast.arguments) -> list[inspect.Parameter]:
    P = inspect.Parameter
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [_param(arg, P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD,
                  default)
           for i, (arg, default) in enumerate(zip(positional, defaults, strict=True))]
    if a.vararg:
        out.append(_param(a.vararg, P.VAR_POSITIONAL, None))
    out += [_param(arg, P.KEYWORD_ONLY, default)
            for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        out.append(_param(a.kwarg, P.VAR_KEYWORD, None))
    return out


def _param(arg: ast.arg, kind, default: ast.expr | None) -> inspect.Parameter:
    return inspect.Parameter(
        arg.arg, kind,
        default=inspect.Parameter.empty if default is None else _Text(ast.unparse(default)),
        annotation=inspect.Parameter.empty if arg.annotation is None
        else _Text(ast.unparse(arg.annotation)))


def check_path(path: str, key: str, source: str, args: dict | None = None,
               args_key: str | None = None) -> None:
    """``path`` names a callable the workers will find, and ``args`` fit its signature
    as far as the source shows; ConfigError (exit 2) naming ``key`` or ``args_key``."""
    module_name, attr = split_path(path, key, source)
    file = find_source(module_name, key, source)
    if file is None:
        return
    tree = parse(file, module_name, key, source)
    node = lookup(tree, file.read_text(encoding="utf-8", errors="replace"), attr)
    if node is False:
        raise ConfigError(source, key, f"{module_name} has no {attr!r} ({file})")
    sig = signature(node) if args is not None else None
    if sig is None:
        return
    try:
        sig.bind(**args)
    except TypeError as exc:
        raise ConfigError(source, args_key or key, f"{exc}; the factory's parameters are "
                                                   f"{sig}") from None
