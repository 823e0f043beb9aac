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
of itself gets torch's behaviour. tests/unit/test_startup.py runs two DDP processes
through checkpoints, evaluation and a resume and checks that neither loads the stack;
bench/startup.py shows what it saves.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Callable

import torch

DYNAMO = "torch._dynamo"
DDP_MODE = "ddp_optimizer"  # get_optimize_ddp_mode() for the default optimize_ddp=True
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


def _until_loaded(fn: Callable, recursive: bool) -> Callable:
    """``fn`` itself while the stand-in is in place; ``torch._dynamo.disable(fn)`` (built
    once) after the real module is loaded."""
    disabled = None

    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if not _replaced():
                return fn(*args, **kwargs)
            disabled = _real().disable(fn, recursive, wrapping=False)
        return disabled(*args, **kwargs)

    return call


class _Utils:
    def get_optimize_ddp_mode(self) -> str:
        return _real().utils.get_optimize_ddp_mode() if _replaced() else DDP_MODE

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
    once it is loaded); any other attribute is the real module's."""

    def __init__(self, spec: importlib.machinery.ModuleSpec) -> None:
        super().__init__(DYNAMO)
        # a package, so that importing a submodule reaches the finder below; and what a
        # scan of sys.modules reads, so that it loads nothing
        self.__spec__, self.__file__ = spec, spec.origin
        self.__path__ = list(spec.submodule_search_locations)
        self.utils, self.eval_frame = _Utils(), _EvalFrame()

    def disable(self, fn: Callable, recursive: bool = True, wrapping: bool = True):
        if _replaced():
            return _real().disable(fn, recursive, wrapping=wrapping)
        return _until_loaded(fn, recursive)

    def graph_break(self, msg: str = "") -> None:
        if _replaced():
            _real().graph_break(msg)

    def is_compiling(self) -> bool:
        return _replaced() and _real().is_compiling()

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


def keep_unloaded() -> bool:
    """Put the stand-in in place unless ``torch._dynamo`` is already loaded; whether it
    was put."""
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
