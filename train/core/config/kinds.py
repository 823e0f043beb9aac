"""Every ``model.kind`` and ``data.kind``: its builder, what it needs, and its own rules.

One entry per kind (torchtitan's ModelSpec is the model for this): the import path of
its builder, imported only inside a worker since builders need torch; what it pairs
with; and the checks that need nothing but the config and the data files, which the
launcher runs before anything starts and the worker runs again. The schema's
``Literal`` choices are these names, and :func:`~train.core.config.checks.validate`
collects every kind's problems without knowing any kind by name.

Adding a kind: a builder (``train/models/builtin.py`` or ``train/data/builders.py``), an
entry here with its rules, then regenerate the config reference.

A rule is ``rules(cfg, fail)``; ``fail(key, problem, *related)`` records one problem of
``key`` (``related``: other keys it reads), and :func:`~.origins.ref` /
:func:`~.origins.val` quote values with their origin.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from train.core.config import hf_kind
from train.core.config.origins import ref, source_of, val
from train.core.datasets import datafiles, tokenfiles, tokenscan

if TYPE_CHECKING:
    from train.core.config.schema import Config

Fail = Callable[..., None]


def _no_rules(cfg: Config, fail: Fail) -> None:
    return None


@dataclass(frozen=True)
class ModelKind:
    name: str
    # "module:function" called as function(model_cfg, input_shape=, num_classes=, source=)
    builder: str
    rules: Callable[[Config, Fail], None] = _no_rules
    data: tuple[str, ...] | None = None  # the data kinds it trains on (None: any)
    blocks: bool = False                 # has a `blocks` ModuleList: activation checkpointing
    tokens: bool = False                 # next-token model: data.vocab_size classes, and a
                                         # sample is model.context_length tokens
    factory: bool = False                # made by the user's model.factory
    takes_args: bool = False             # reads model.args (its factory's, or its own keys)
    own_loss: bool = False               # may compute its own loss (train.loss: model)
    # the model.* keys it reads besides kind: what an export's model.json records
    keys: tuple[str, ...] = ()
    # its parameter count from the config alone (None: only the built model knows)
    parameters: Callable[[Config], int | None] = lambda cfg: None


@dataclass(frozen=True)
class DataKind:
    name: str
    builder: str                         # "module:function" called as function(cfg, source)
    rules: Callable[[Config, Fail], None] = _no_rules
    files: Callable[[Config, Fail], None] = _no_rules  # checks of the data files themselves
    models: tuple[str, ...] | None = None  # the model kinds it feeds (None: any)
    sample_bytes: Callable[[Config], int | None] = lambda cfg: None  # one loaded sample
    factory: bool = False                # made by the user's data.factory
    takes_args: bool = False             # reads data.args (its factory's)


# ---------------------------------------------------------------------- models

def _gpt_rules(cfg: Config, fail: Fail) -> None:
    if cfg.model.width % cfg.model.heads:
        fail("model.heads", f"{val('model.heads')} does not divide {ref('model.width')}",
             "model.kind")


def _cnn_rules(cfg: Config, fail: Fail) -> None:
    if cfg.data.kind == "synthetic" and len(cfg.data.shape) != 3:
        fail("data.shape", f"{ref('model.kind')} needs [channels, height, width], got "
                           f"{val('data.shape')}", "data.kind")


TEXT_VOCAB = 256  # the text kind is byte-level


def _gpt_parameters(cfg: Config) -> int:
    """train/models/builtin.py's GPT: embeddings, depth x (2 LayerNorms, qkv, proj, 4x MLP), the
    final LayerNorm and the head (none of its own when tied to the token embedding)."""
    m = cfg.model
    vocab = TEXT_VOCAB if cfg.data.kind == "text" else cfg.data.vocab_size
    w = m.width
    block = 4 * w + (3 * w * w + 3 * w) + (w * w + w) + (4 * w * w + 4 * w) + (4 * w * w + w)
    return (vocab + m.context_length) * w + m.depth * block + 2 * w + \
        (0 if m.tie_weights else vocab * w)


def _mlp_parameters(cfg: Config) -> int | None:
    """train/models/builtin.py's MLP on synthetic data (other data: the shape is in the file)."""
    if cfg.data.kind != "synthetic":
        return None
    inputs = 1
    for s in cfg.data.shape:
        inputs *= s
    widths = [inputs] + [cfg.model.width] * cfg.model.depth + [cfg.data.num_classes]
    return sum(a * b + b for a, b in itertools.pairwise(widths))


MODEL_KINDS: dict[str, ModelKind] = {k.name: k for k in (
    ModelKind("mlp", "train.models.builtin:mlp", parameters=_mlp_parameters,
              keys=("depth", "width", "dropout")),
    ModelKind("cnn", "train.models.builtin:cnn", _cnn_rules, keys=("depth", "width", "dropout")),
    ModelKind("gpt", "train.models.builtin:gpt", _gpt_rules, data=("text", "tokens", "custom"),
              blocks=True, tokens=True, parameters=_gpt_parameters,
              keys=("depth", "width", "heads", "context_length", "dropout", "tie_weights")),
    ModelKind("custom", "train.models.builtin:from_factory", blocks=True, factory=True,
              takes_args=True, own_loss=True, keys=("factory", "args", "context_length")),
    ModelKind("hf", "train.models.hf:build", hf_kind.rules, data=("text", "tokens", "custom"),
              blocks=True, tokens=True, takes_args=True, own_loss=True,
              keys=("args", "context_length")),
)}


# ------------------------------------------------------------------------ data

# Token files up to this size are scanned for ids >= data.vocab_size before training
# (about a second per GiB); larger ones are checked batch by batch.
TOKEN_SCAN_LIMIT = 2 << 30


def _token_sample_bytes(cfg: Config) -> int:
    return 2 * cfg.model.context_length * 8  # int64 inputs and next tokens


def _synthetic_sample_bytes(cfg: Config) -> int:
    size = 1
    for s in cfg.data.shape:
        size *= s
    return size * 4 + 8  # float32 features + int64 label


def _required_path(cfg: Config, fail: Fail) -> bool:
    if not cfg.data.path:
        fail("data.path", f"required for {ref('data.kind')}")
        return False
    if not isinstance(cfg.data.path, str):
        fail("data.path", f"a list of files is for data.kind=tokens; {ref('data.kind')} "
                          "reads one path")
        return False
    if not Path(cfg.data.path).is_file():
        fail("data.path", f"{cfg.data.path}: no such file")
        return False
    return True


def _text_files(cfg: Config, fail: Fail) -> None:
    """A folder holds enough text under data.text_glob; or the files and objects data.path
    names are there, hold enough text, and data.cache_bytes holds the largest object."""
    d = cfg.data
    if d.path is None:
        return  # the standard library's source
    if datafiles.is_text_folder(d.path):
        return datafiles.check_text(Path(d.path), d.text_glob, d.max_bytes,
                                    cfg.model.context_length)
    source = source_of(cfg, "data.path", "config")
    files = tokenfiles.resolve(d.path, source, "text")
    datafiles.enough_text(source, [f.size for f in files], d.max_bytes,
                          cfg.model.context_length)
    _cache_holds_each(cfg, files, fail)


def _tokens_files(cfg: Config, fail: Fail) -> None:
    """Every file is there and holds uint16 ids (no id >= data.vocab_size in the local
    ones, up to TOKEN_SCAN_LIMIT bytes of them; the rest is checked batch by batch);
    data.cache_bytes holds the largest object."""
    d = cfg.data
    files = tokenfiles.resolve(d.path, source_of(cfg, "data.path", "config"))
    for f in files:
        if f.size < 4 or f.size % 2:
            return fail("data.path", f"{f.name}: not a uint16 token file (odd or tiny size)")
    scanned = 0
    for f in (f for f in files if not f.remote):
        scanned += f.size
        if scanned > TOKEN_SCAN_LIMIT:
            break
        top = tokenscan.largest(Path(f.name), cfg.run_dir)
        if top >= d.vocab_size:
            return fail("data.vocab_size", f"{val('data.vocab_size')} but {f.name} (in "
                                           f"{ref('data.path')}) holds token id {top}; set "
                                           f"data.vocab_size to at least {top + 1}")
    _cache_holds_each(cfg, files, fail)


def _cache_holds_each(cfg: Config, files: list[tokenfiles.TokenFile], fail: Fail) -> None:
    """The cache holds the largest object (windows), or two of it (blocks: the group
    training and the next one arriving)."""
    largest = max((f.size for f in files if f.remote), default=0)
    if cfg.data.shuffle == "blocks" and 2 * largest > cfg.data.cache_bytes:
        fail("data.cache_bytes", f"{val('data.cache_bytes')} holds less than two of the "
                                 f"largest file of {ref('data.path')} ({largest} bytes), "
                                 f"which data.shuffle=blocks needs; raise it to at least "
                                 f"{2 * largest}")
    elif largest > cfg.data.cache_bytes:
        fail("data.cache_bytes", f"{val('data.cache_bytes')} is less than the largest file "
                                 f"of {ref('data.path')} ({largest} bytes); raise it to at "
                                 f"least that (to the dataset's size to fetch each file once, "
                                 f"or {2 * largest} with data.shuffle=blocks)")


def _tensors_files(cfg: Config, fail: Fail) -> None:
    if not _required_path(cfg, fail):
        return
    path, d = Path(cfg.data.path), cfg.data
    if path.suffix not in (".pt", ".npy"):
        return fail("data.path", f"{d.path}: expected a .pt or .npy file")
    if path.suffix == ".npy":
        if not d.labels_path:
            return fail("data.labels_path", f"required when {ref('data.path')} is a .npy file")
        if not Path(d.labels_path).is_file():
            return fail("data.labels_path", f"{d.labels_path}: no such file")
    datafiles.check_tensors(path, d.labels_path)


TOKEN_MODELS = ("gpt", "custom", "hf")
DATA_KINDS: dict[str, DataKind] = {k.name: k for k in (
    DataKind("synthetic", "train.data.builders:synthetic", sample_bytes=_synthetic_sample_bytes),
    DataKind("tensors", "train.data.builders:tensors", files=_tensors_files),
    DataKind("text", "train.data.builders:text", files=_text_files, models=TOKEN_MODELS,
             sample_bytes=_token_sample_bytes),
    DataKind("tokens", "train.data.builders:tokens", files=_tokens_files, models=TOKEN_MODELS,
             sample_bytes=_token_sample_bytes),
    DataKind("custom", "train.data.builders:from_factory", factory=True, takes_args=True),
)}

# train.loss names that are no import path (train/models/losses.py: NAMES); "model" is the
# model's own loss, which only the user's model can compute (check_pairing).
BUILT_IN_LOSSES = ("cross_entropy", "mse", "model")

MODEL_KIND_NAMES = tuple(MODEL_KINDS)
DATA_KIND_NAMES = tuple(DATA_KINDS)


# --------------------------------------------------------------- the collector's part

def model_kind(cfg: Config) -> ModelKind:
    return MODEL_KINDS[cfg.model.kind]


def data_kind(cfg: Config) -> DataKind:
    return DATA_KINDS[cfg.data.kind]


def check_pairing(cfg: Config, fail: Fail) -> None:
    """The factory keys go with a factory kind, both ways; the model and data kinds must
    fit each other; each kind's own rules."""
    for section, kind in (("model", model_kind(cfg)), ("data", data_kind(cfg))):
        part = getattr(cfg, section)
        if kind.factory and not part.factory:
            fail(f"{section}.factory", f"required for {ref(section + '.kind')}: the import "
                                       "path of your factory, e.g. mypkg.module:build")
        if not kind.factory and part.factory:
            fail(f"{section}.factory", f"only for {section}.kind=custom, got "
                                       f"{ref(section + '.kind')}")
        elif not kind.takes_args and part.args:
            fail(f"{section}.args", f"only for {section}.kind="
                                    f"{'custom or hf' if section == 'model' else 'custom'}, "
                                    f"got {ref(section + '.kind')}")
    model, data = model_kind(cfg), data_kind(cfg)
    _own_loss_rules(cfg, model, data, fail)
    model.rules(cfg, fail)
    if model.data is not None and data.name not in model.data:
        fail("data.kind", f"{ref('model.kind')} needs {_either(model.data)} data, got "
                          f"{val('data.kind')}")
    elif data.models is not None and model.name not in data.models:
        fail("data.kind", f"{val('data.kind')} data needs model.kind {_either(data.models)}, "
                          f"got {ref('model.kind')}")
    data.rules(cfg, fail)


def _own_loss_rules(cfg: Config, model: ModelKind, data: DataKind, fail: Fail) -> None:
    """train.loss=model: the user's model computes it from labels=targets."""
    if cfg.train.loss != "model":
        return
    if not model.own_loss:
        fail("train.loss", f"model (the model's own loss) needs a model that computes one "
                           f"(model.kind custom or hf), got {ref('model.kind')}, which returns "
                           "logits: use cross_entropy or mse")
    elif data.name in ("text", "tokens"):
        # A causal LM shifts its labels itself: given these targets it would learn the
        # token after next, silently.
        fail("train.loss", f"model with {ref('data.kind')}: its targets are the next "
                           "tokens already, and a causal LM's own loss shifts its labels "
                           "again; use cross_entropy (it takes the model's logits), or "
                           "custom data whose targets are the labels your model expects")


def _either(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def load_builder(path: str) -> Callable[..., Any]:
    """The builder a kind names (imports the module: torch, inside a worker)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
