"""The user's own code: models, datasets and losses named by import path in the config.

``model.factory``, ``data.factory`` and ``train.loss`` may name a callable as
``package.module:name`` (or ``package.module.name``). It is imported from the working
directory (the mounted project, ``/workspace`` in the image; the current directory in a
checkout) or from an installed package, and called with the config's ``args`` as
keyword arguments. Every mistake is one :class:`~train.core.errors.ConfigError` (exit 2)
naming the key and the first line of the error. The launcher checks the paths and the
arguments by reading the source, running none of it (:func:`check_without_running`,
:mod:`train.core.user.usersource`: a factory module that imports transformers would cost
seconds there, and every worker imports it anyway); each worker imports and checks them
(:func:`check`), then calls them before step 1, where a failure is the same one line.

The manifest records which of the user's files were imported, with their hashes
(:func:`imported_files`), so a run says which code it trained.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from train.core.errors import ConfigError, UserError
from train.core.user.usersource import split_path

# This project's own packages: never counted as the user's code.
_ROOT = Path(__file__).resolve().parents[2]
OWN_PACKAGES = (_ROOT / "train", _ROOT / "launcher")


def project_dir() -> Path:
    """Where the user's code lives: the working directory, importable from here on."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    return Path(here)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def resolve(path: str, key: str, source: str) -> Callable[..., Any]:
    """The callable ``path`` names; ConfigError naming ``key`` when it cannot be found."""
    project_dir()
    module_name, attr = split_path(path, key, source)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error raised while importing the module
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "torch":
            raise  # this environment lacks torch, not the user's mistake: the exit-3 line
        raise ConfigError(source, key, f"cannot import {module_name} (from {os.getcwd()} or "
                                       f"installed packages): {_first_line(exc)}") from None
    target = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(source, key, f"{module_name} has no {attr!r}")
    if not callable(target):
        raise ConfigError(source, key, f"{path} is not callable")
    return target


def check_args(fn: Callable[..., Any], args: dict[str, Any], key: str, source: str) -> None:
    """The arguments fit the callable's signature (nothing is called)."""
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as exc:
        raise ConfigError(source, key, f"{exc}; the factory's parameters are "
                                       f"{inspect.signature(fn)}") from None
    except ValueError:  # no signature to read (a builtin): the call will tell
        pass


def call(path: str, args: dict[str, Any], key: str, source: str) -> Any:
    """Import and call a factory; its failure is one line naming the key."""
    fn = resolve(path, f"{key}.factory", source)
    check_args(fn, args, f"{key}.args", source)
    try:
        return fn(**args)
    except UserError:
        raise  # ours, raised in the user's code (train.data.remote): its own line and code
    except Exception as exc:
        raise ConfigError(source, f"{key}.factory", f"{path}(**{key}.args) failed: "
                                                    f"{_first_line(exc)}") from None


def check_without_running(cfg, source: str) -> None:
    """The launcher's checks: every import path is found and the config's arguments fit
    what its source shows; nothing of the user's code is imported or run."""
    from train.core.config.kinds import BUILT_IN_LOSSES, data_kind, model_kind
    from train.core.user import usersource
    if cfg.model.kind == "hf":  # no user code: transformers' own classes, built on meta
        from train.core.config import hf_kind
        hf_kind.check(cfg, source)
    if model_kind(cfg).factory:
        usersource.check_path(cfg.model.factory, "model.factory", source, cfg.model.args,
                              "model.args")
    if cfg.train.loss not in BUILT_IN_LOSSES:
        _check_loss_name(cfg.train.loss, BUILT_IN_LOSSES, source)
        usersource.check_path(cfg.train.loss, "train.loss", source)
    if data_kind(cfg).factory:
        usersource.check_path(cfg.data.factory, "data.factory", source, cfg.data.args,
                              "data.args")


def check(cfg, source: str, *, module: bool = False) -> None:
    """A worker's checks: every import path resolves and takes its arguments; with
    ``module`` (a worker without the launcher), the model factory builds a module on the
    meta device before anything is written. The dataset is built, and the model and the
    loss run on one sample, where the worker builds them (before step 1)."""
    from train.core.config.kinds import BUILT_IN_LOSSES, data_kind, model_kind
    if cfg.model.kind == "hf" and module:  # a worker without the launcher's check
        from train.core.config import hf_kind
        hf_kind.check(cfg, source)
    if model_kind(cfg).factory:
        fn = resolve(cfg.model.factory, "model.factory", source)
        check_args(fn, cfg.model.args, "model.args", source)
        if module:
            check_builds_a_module(fn, cfg.model.factory, cfg.model.args, source)
    if cfg.train.loss not in BUILT_IN_LOSSES:
        _check_loss_name(cfg.train.loss, BUILT_IN_LOSSES, source)
        resolve(cfg.train.loss, "train.loss", source)
    if data_kind(cfg).factory:
        fn = resolve(cfg.data.factory, "data.factory", source)
        check_args(fn, cfg.data.args, "data.args", source)


def _check_loss_name(loss: str, built_in: tuple[str, ...], source: str) -> None:
    """A loss that is not built in is an import path; a bare word is a misspelt built-in."""
    if ":" not in loss and "." not in loss:
        close = difflib.get_close_matches(loss.lower(), built_in, n=1, cutoff=0.7)
        raise ConfigError(source, "train.loss", f"got {loss!r}; expected one of "
                                                f"{', '.join(built_in)} or an import path like "
                                                "'package.module:name'"
                                                + (f"; did you mean {close[0]}?" if close else ""))


def check_builds_a_module(fn: Callable[..., Any], path: str, args: dict[str, Any],
                          source: str) -> None:
    """The model factory, called once on the meta device (no memory, no weights), returns
    a torch.nn.Module. A factory that cannot build there (it loads weights, say) is left
    to the worker: only a clear answer is an error."""
    import torch
    try:
        with torch.device("meta"):
            made = fn(**args)
    except Exception:  # user code, any error: only the worker's real build can tell
        return
    if not isinstance(made, torch.nn.Module):
        raise ConfigError(source, "model.factory", f"{path} returned {type(made).__name__}, "
                                                   "not a torch.nn.Module")


def split_datasets(made: Any, source: str) -> tuple[Any, Any | None]:
    """A dataset, or (train, validation) as a pair or a dict with those keys."""
    if isinstance(made, dict) and "train" in made:
        return made["train"], made.get("val", made.get("validation"))
    if isinstance(made, (tuple, list)) and len(made) == 2 and all(_is_dataset(d) for d in made):
        return made[0], made[1]
    if _is_dataset(made):
        return made, None
    raise ConfigError(source, "data.factory", f"returned {type(made).__name__}; expected a "
                                              "map-style dataset (__len__ and __getitem__), or "
                                              "(train, validation) datasets")


def _is_dataset(obj: Any) -> bool:
    return hasattr(obj, "__len__") and hasattr(obj, "__getitem__")


def first_sample(dataset: Any, source: str) -> tuple[Any, Any]:
    """Sample 0 as (input, target); ConfigError when the dataset cannot give one."""
    try:
        n = len(dataset)
        item = dataset[0] if n else None
    except Exception as exc:
        raise ConfigError(source, "data.factory", f"the dataset cannot give sample 0: "
                                                  f"{_first_line(exc)}") from None
    if n < 2:
        raise ConfigError(source, "data.factory", f"the dataset has {n} sample(s); need at "
                                                  "least 2")
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ConfigError(source, "data.factory", f"sample 0 is a {type(item).__name__}; each "
                                                  "sample must be an (input, target) pair")
    return item[0], item[1]


def imported_files(root: Path | None = None) -> dict[str, str]:
    """The user's Python files imported so far (under the project directory, this
    package excluded), relative path -> SHA-256.

    Rank 0 asks before its first step, with some 2,000 modules loaded (torch's): each
    module's folder is resolved once, not each file (Path.resolve per module took
    0.1-0.2 CPU-s, and rank 0's start is every rank's wait)."""
    from train.core.files import sha256_file
    root = (root or Path(os.getcwd())).resolve()
    under_root = os.path.join(str(root), "")  # "/project/" (and "/" for the root itself)
    own = tuple(os.path.join(str(package), "") for package in OWN_PACKAGES)
    folders: dict[str, str] = {}
    out = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not path:
            continue
        real = _real_path(path, folders)
        if not real.endswith(".py") or not real.startswith(under_root) or real.startswith(own):
            continue
        p = Path(real)
        if ".venv" in p.parts or "site-packages" in p.parts or not p.is_file():
            continue
        out[str(p.relative_to(root))] = sha256_file(p)
    return dict(sorted(out.items()))


def _real_path(path: str, folders: dict[str, str]) -> str:
    """``path`` with every symbolic link resolved, its folder's resolution cached in
    ``folders`` (a file that is itself a link is resolved on its own)."""
    folder, name = os.path.split(os.path.abspath(path))
    if folder not in folders:
        folders[folder] = os.path.realpath(folder)
    real = os.path.join(folders[folder], name)
    return os.path.realpath(real) if os.path.islink(real) else real
