"""The user's own code: models, datasets and losses named by import path in the config.

``model.factory``, ``data.factory`` and ``train.loss`` may name a callable as
``package.module:name`` (or ``package.module.name``). It is imported from the working
directory (the mounted project, ``/workspace`` in the image; the current directory in a
checkout) or from an installed package, and called with the config's ``args`` as
keyword arguments. Every mistake is one :class:`~train.core.errors.ConfigError` (exit 2)
naming the key and the first line of the error, checked by the launcher before any
worker starts (:func:`check`) and again, the same way, where the worker calls it.

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

from train.core.errors import ConfigError

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
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(source, key, f"got {path!r}; expected an import path like "
                                       "'package.module:name'")
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
    except Exception as exc:
        raise ConfigError(source, f"{key}.factory", f"{path}(**{key}.args) failed: "
                                                    f"{_first_line(exc)}") from None


def check(cfg, source: str, *, sample: bool, module: bool = False) -> None:
    """The parent's checks: every import path resolves and takes its arguments; with
    ``sample``, the dataset is built and yields an (input, target) pair; with ``sample``
    or ``module``, the model factory builds a module (on the meta device)."""
    from train.core.config.kinds import BUILT_IN_LOSSES, data_kind, model_kind
    if cfg.model.kind == "hf" and (sample or module):  # no factory: transformers' classes
        from train.core.config import hf_kind
        hf_kind.check(cfg, source)
    if model_kind(cfg).factory:
        fn = resolve(cfg.model.factory, "model.factory", source)
        check_args(fn, cfg.model.args, "model.args", source)
        if sample or module:
            check_builds_a_module(fn, cfg.model.factory, cfg.model.args, source)
    if cfg.train.loss not in BUILT_IN_LOSSES:
        _check_loss_path(cfg.train.loss, BUILT_IN_LOSSES, source)
    if data_kind(cfg).factory:
        fn = resolve(cfg.data.factory, "data.factory", source)
        check_args(fn, cfg.data.args, "data.args", source)
        if sample:
            train, _ = split_datasets(call(cfg.data.factory, cfg.data.args, "data", source),
                                      source)
            first_sample(train, source)


def _check_loss_path(loss: str, built_in: tuple[str, ...], source: str) -> None:
    """A loss that is not built in is an import path; a bare word is a misspelt built-in."""
    if ":" not in loss and "." not in loss:
        close = difflib.get_close_matches(loss.lower(), built_in, n=1, cutoff=0.7)
        raise ConfigError(source, "train.loss", f"got {loss!r}; expected one of "
                                                f"{', '.join(built_in)} or an import path like "
                                                "'package.module:name'"
                                                + (f"; did you mean {close[0]}?" if close else ""))
    resolve(loss, "train.loss", source)


def check_builds_a_module(fn: Callable[..., Any], path: str, args: dict[str, Any],
                          source: str) -> None:
    """The model factory, called once on the meta device (no memory, no weights), returns
    a torch.nn.Module. A factory that cannot build there (it loads weights, say) is left
    to the worker: only a clear answer is an error."""
    import torch
    try:
        with torch.device("meta"):
            made = fn(**args)
    except Exception:
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
    package excluded), relative path -> SHA-256."""
    from train.core.files import sha256_file
    root = (root or Path(os.getcwd())).resolve()
    out = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path:
            continue
        p = Path(path).resolve()
        if p.suffix != ".py" or not p.is_file() or any(own in p.parents for own in OWN_PACKAGES) \
                or root not in p.parents or ".venv" in p.parts or "site-packages" in p.parts:
            continue
        out[str(p.relative_to(root))] = sha256_file(p)
    return dict(sorted(out.items()))
