"""A run that compiles nothing does not load torch's compiler stack.

torch 2.13 imports ``torch._dynamo`` (and ``torch._inductor`` with it: about 800 modules,
1.3 CPU-s per process here, a third of a worker's start) when an optimizer, DDP or the
distributed state-dict API is first used, though none of them compiles anything. They ask
the module five things:

- ``disable(fn)``: functions torch marks ``torch._disable_dynamo``
  (``Optimizer.add_param_group``, called by every optimizer's constructor; DDP's
  ``_inside_ddp_forward``) build their "do not trace this" wrapper at their first call
  (torch/_compile.py);
- ``graph_break()``: every optimizer ``step`` (torch/optim/optimizer.py
  ``_use_grad_for_differentiable``);
- ``is_compiling()``;
- ``utils.get_optimize_ddp_mode()``: DDP's constructor, to choose between its C++
  reducer and the Python one that compiled autograd uses;
- ``eval_frame.OptimizedModule``: ``get_state_dict`` (every checkpoint), to see through
  a compiled module.

None of them needs the compiler while nothing is being compiled: "do not trace" and
"break the graph here" only act while dynamo traces, which needs dynamo loaded; nothing
is compiling, and no module is a compiled one; and the reducer mode is the config's
default ("ddp_optimizer") until someone imports ``torch._dynamo`` to change it. So, in
a run with ``compile`` off, :func:`keep_unloaded` puts a stand-in at
``sys.modules["torch._dynamo"]`` that answers those five and loads the real module for
anything else (any other attribute, or the import of one of its submodules such as
``torch._dynamo.config``), which then stays. A function wrapped by ``disable`` before
then goes through torch's own ``disable`` from then on, so a model that compiles a part
of itself gets torch's behaviour.

It fails open, because a wrong answer breaks a user's model where torch's own would have
worked: each answer takes whatever torch's function takes (torch's parameters, then
``*args, **kwargs``) and answers only the call shapes torch itself makes (``disable`` of
a plain function, with ``recursive``, ``reason`` and ``wrapping``; the others with no
argument); any other call (``disable(recursive=False)`` as a decorator factory, of a
module or a class, an argument a later torch adds) goes to the real module, loading it.
It is put in place only for the torch versions in :data:`STAND_IN_TORCH`, whose
signatures tests/unit/test_startup.py compares with torch's own (a new torch's new
questions would otherwise be answered by guesswork), never under FSDP (the caller's
choice), and not when ``TRAIN_KEEP_COMPILER_UNLOADED=0``. tests/unit/test_startup.py runs
two DDP processes through checkpoints, evaluation and a resume and checks that neither
loads the stack; bench/startup.py shows what it saves.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Callable

import torch

from train.core.run.identity import WorkerIdentity

DYNAMO = "torch._dynamo"
DDP_MODE = "ddp_optimizer"  # get_optimize_ddp_mode() for the default optimize_ddp=True
# The torch versions (major.minor) whose questions the stand-in is tested to answer; the
# Makefile's TORCH_VERSION must be one of them (tests/unit/test_startup.py checks it).
STAND_IN_TORCH = ("2.13",)
_loading = threading.Lock()


def _real() -> types.ModuleType:
    """The real torch._dynamo, loaded in place of the stand-in if need be."""
    with _loading:
        if isinstance(sys.modules.get(DYNAMO), _StandIn):
            del sys.modules[DYNAMO]
    # outside the lock: a thread importing a module that the package imports may ask for
    # it too, and importlib's own per-module locks order them
    return importlib.import_module(DYNAMO)


def _replaced() -> bool:
    """Whether the real module is loaded (the stand-in may live on in a name someone
    bound while it was in place)."""
    return not isinstance(sys.modules.get(DYNAMO), _StandIn)


def _plain_function(fn) -> bool:
    """Whether the stand-in's ``disable`` can wrap ``fn`` as torch's would: a callable
    that is neither a class nor a module (torch patches a class's methods in place and
    turns a module into an OptimizedModule) nor a wrapper dynamo made (it unwraps those)."""
    return callable(fn) and not isinstance(fn, (type, torch.nn.Module)) and \
        not hasattr(fn, "_torchdynamo_orig_callable")


def _until_loaded(fn: Callable, recursive: bool, reason: str | None,
                  wrapping: bool) -> Callable:
    """``fn`` itself while the stand-in is in place; ``torch._dynamo.disable(fn)`` (built
    once, with the same ``recursive`` and ``reason``) after the real module is loaded.
    ``wrapping`` as torch's: copy ``fn``'s name and docstring onto the wrapper."""
    disabled = None

    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if not _replaced():
                return fn(*args, **kwargs)
            disabled = _real().disable(fn, recursive, reason=reason, wrapping=False)
        return disabled(*args, **kwargs)

    return functools.wraps(fn)(call) if wrapping else call


class _Utils:
    def get_optimize_ddp_mode(self, *args, **kwargs) -> str:
        if _replaced() or args or kwargs:
            return _real().utils.get_optimize_ddp_mode(*args, **kwargs)
        return DDP_MODE

    def __getattr__(self, name: str):
        return getattr(_real().utils, name)


class _NotCompiled:
    """torch._dynamo.eval_frame.OptimizedModule while the stand-in is in place: nothing
    can be compiled then, so nothing is an instance."""


class _EvalFrame:
    @property
    def OptimizedModule(self) -> type:
        return _real().eval_frame.OptimizedModule if _replaced() else _NotCompiled

    def __getattr__(self, name: str):
        return getattr(_real().eval_frame, name)


class _StandIn(types.ModuleType):
    """``torch._dynamo`` while nothing compiles: the five answers (the real module's
    once it is loaded, and for any call shape they do not answer themselves); any other
    attribute is the real module's."""

    def __init__(self, spec: importlib.machinery.ModuleSpec) -> None:
        super().__init__(DYNAMO)
        # a package, so that importing a submodule reaches the finder below; and what a
        # scan of sys.modules reads, so that it loads nothing
        self.__spec__, self.__file__ = spec, spec.origin
        self.__path__ = list(spec.submodule_search_locations)
        self.utils, self.eval_frame = _Utils(), _EvalFrame()

    # torch's parameters, names, kinds and defaults (tests/unit/test_startup.py compares
    # them), then *args and **kwargs: a call the stand-in does not answer goes to torch.
    def disable(self, fn=None, recursive=True, *args, reason=None, wrapping=True, **kwargs):
        if _replaced() or args or kwargs or not _plain_function(fn):
            return _real().disable(fn, recursive, *args, reason=reason, wrapping=wrapping,
                                   **kwargs)
        return _until_loaded(fn, recursive, reason, wrapping)

    def graph_break(self, msg: str = "", *args, **kwargs) -> None:
        if _replaced() or args or kwargs:
            return _real().graph_break(msg, *args, **kwargs)
        return None

    def is_compiling(self, *args, **kwargs) -> bool:
        if _replaced() or args or kwargs:
            return _real().is_compiling(*args, **kwargs)
        return False

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_real(), name)


class _Loaded(importlib.abc.Loader):
    """Hands importlib a submodule that loading the real package already loaded (its own
    spec kept), so that no second copy of it is made."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        if getattr(module, "__spec__", None) is not self.spec:
            try:  # importlib set it to the spec below (where the module lets it)
                module.__spec__ = self.spec
            except AttributeError:
                pass


class _Submodules(importlib.abc.MetaPathFinder):
    """The import of a ``torch._dynamo`` submodule while the stand-in is in place: load
    the real package first. (It stays on sys.meta_path, inert, afterwards: removing a
    finder while importlib walks the list would skip the next one.)"""

    def find_spec(self, name, path=None, target=None):
        if not name.startswith(DYNAMO + ".") or not isinstance(sys.modules.get(DYNAMO),
                                                                 _StandIn):
            return None
        _real()
        module = sys.modules.pop(name, None)  # importlib puts it back, as it is
        if module is None:
            return None  # not among what the package loads: the usual finders find it
        return importlib.util.spec_from_loader(name, _Loaded(module),
                                               is_package=hasattr(module, "__path__"))


_finder = _Submodules()


def covered(version: str) -> bool:
    """Whether a torch version (``2.13.0+cpu``) is one the stand-in is tested against."""
    return ".".join(version.split("+")[0].split(".")[:2]) in STAND_IN_TORCH


def keep_unloaded(env: WorkerIdentity | None = None) -> bool:
    """Put the stand-in in place unless ``torch._dynamo`` is already loaded, this torch is
    not one :data:`STAND_IN_TORCH` names, or the environment turns it off
    (``TRAIN_KEEP_COMPILER_UNLOADED=0``); whether it was put."""
    env = WorkerIdentity.from_environ() if env is None else env
    if not env.keep_compiler_unloaded or not covered(torch.__version__):
        return False
    with _loading:
        if DYNAMO in sys.modules:
            return False
        spec = importlib.machinery.PathFinder.find_spec(DYNAMO, torch.__path__)
        if spec is None or not spec.submodule_search_locations:
            return False
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        sys.modules[DYNAMO] = _StandIn(spec)
        return True
