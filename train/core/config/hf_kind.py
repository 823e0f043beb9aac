"""``model.kind: hf``: a transformers causal-LM architecture named by the config, no factory.

``model.args`` holds three keys, named after what transformers users already write:

- ``config``: a configuration class (``GPT2Config``) or its ``model_type`` (``gpt2``), built
  with transformers' defaults; or a local directory holding a ``config.json``. Random
  initialisation (from ``seed``).
- ``pretrained``: a local directory ``from_pretrained`` reads (config.json and weights):
  training starts from those weights. Offline only: a name that is no directory here is
  an error, never a hub download.
- ``overrides``: fields of that configuration to change (``{n_layer: 2, n_embd: 128}``);
  each must be a field the configuration class has. They go to its constructor
  (``GPT2Config(**overrides)``; a directory's config.json fields with them on top), so
  the fields it derives (Llama's ``head_dim``) follow them.

Exactly one of ``config`` and ``pretrained``. The vocabulary comes from the data: a
configuration built here gets the data's vocabulary (256 bytes for ``data.kind: text``,
``data.vocab_size`` otherwise) unless ``overrides`` sets ``vocab_size``; any model must
have at least as many outputs as the data has token ids, and must accept
``model.context_length`` positions.

The structural rules (:func:`rules`) need nothing but the config; :func:`check` and
:func:`model_config` import transformers (whose configuration classes import torch:
about 3 s of CPU with the meta-device build) inside the function, so that importing this
module stays free of both.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from train.core.config.origins import source_of
from train.core.errors import CannotRunHere, ConfigError

if TYPE_CHECKING:
    from train.core.config.schema import Config

ARG_KEYS = ("config", "pretrained", "overrides")
TEXT_VOCAB = 256  # data.kind text is byte-level
INSTALL = ("transformers is not installed here; model.kind hf needs it: "
           "pip install 'trainpod[hf]' (in a checkout: make hf)")
# Set by us (not by the user) for training: no key/value cache kept between forwards.
TRAINING_DEFAULTS = {"use_cache": False}


def rules(cfg: Config, fail) -> None:
    """model.args' shape, and the directories it names: no import."""
    args = cfg.model.args
    for key in args:
        if key not in ARG_KEYS:
            close = difflib.get_close_matches(key, ARG_KEYS, n=1)
            fail(f"model.args.{key}", "not a key of model.kind=hf; it takes "
                                      f"{', '.join(ARG_KEYS)}"
                                      + (f"; did you mean {close[0]}?" if close else ""))
    given = [k for k in ("config", "pretrained") if args.get(k) is not None]
    if len(given) != 1:
        fail("model.args", "model.kind=hf needs exactly one of model.args.config (a "
                           "configuration class such as GPT2Config, its model_type such as "
                           "gpt2, or a directory with config.json) and model.args.pretrained "
                           f"(a local from_pretrained directory); got {len(given)}")
    for key in given:
        if not isinstance(args[key], str) or not args[key]:
            fail(f"model.args.{key}", f"got {args[key]!r}; expected a name or a directory")
    if not isinstance(args.get("overrides", {}), dict):
        fail("model.args.overrides", f"got {args['overrides']!r}; expected a mapping of "
                                     "configuration fields, e.g. {n_layer: 2}")
    for key in given:
        if isinstance(args[key], str) and args[key] and (key == "pretrained"
                                                         or looks_like_path(args[key])):
            problem = directory_problem(Path(args[key]), weights=key == "pretrained")
            if problem:
                fail(f"model.args.{key}", problem)


def looks_like_path(name: str) -> bool:
    return "/" in name or name.startswith(".") or Path(name).is_dir()


# The weights files from_pretrained reads, one of which a pretrained directory holds.
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
           "pytorch_model.bin.index.json")


def directory_problem(path: Path, *, weights: bool = False) -> str | None:
    if not path.is_dir():
        return (f"{path}: no such directory (only local directories are read; nothing is "
                "downloaded)")
    if not (path / "config.json").is_file():
        return f"{path}: no config.json in it (a save_pretrained directory has one)"
    if weights and not any((path / name).is_file() for name in WEIGHTS):
        return (f"{path}: no weights in it ({', '.join(WEIGHTS)}); for a configuration "
                "alone, use model.args.config")
    return None


def data_vocab(cfg: Config) -> int:
    """How many token ids the data holds: the bytes of text, else data.vocab_size."""
    return TEXT_VOCAB if cfg.data.kind == "text" else cfg.data.vocab_size


def _transformers():
    try:
        import transformers
    except ImportError:
        raise CannotRunHere(INSTALL) from None
    return transformers


def config_class(name: str, cfg: Config, source: str):
    """The configuration class ``name`` means: a class name or a model_type."""
    transformers = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
    if name in CONFIG_MAPPING_NAMES:
        return CONFIG_MAPPING[name]
    found = getattr(transformers, name, None) if name.endswith("Config") else None
    if isinstance(found, type) and issubclass(found, transformers.PretrainedConfig):
        return found
    choices = [*CONFIG_MAPPING_NAMES.values(), *CONFIG_MAPPING_NAMES]
    close = difflib.get_close_matches(name, choices, n=1)
    raise _error(cfg, source, "model.args.config", (
        f"{name!r} is no transformers configuration class or model_type (e.g. GPT2Config or "
        "gpt2), nor a directory holding config.json"
        + (f"; did you mean {close[0]}?" if close else "")))


def _base_config(cfg: Config, source: str):
    """The configuration before overrides; a function building it with overrides (as
    keyword arguments); and which key it came from."""
    args = cfg.model.args
    key = "pretrained" if args.get("pretrained") else "config"
    name = args[key]
    if key == "pretrained" or looks_like_path(name):
        problem = directory_problem(Path(name), weights=key == "pretrained")
        if problem:
            raise _error(cfg, source, f"model.args.{key}", problem)
        try:
            model_type = json.loads((Path(name) / "config.json").read_text())["model_type"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise _error(cfg, source, f"model.args.{key}", (
                f"{Path(name) / 'config.json'}: unreadable or without model_type "
                f"({type(exc).__name__})")) from None
        cls = config_class(model_type, cfg, source)
        saved, _ = cls.get_config_dict(name, local_files_only=True)
        # from_pretrained(name, **overrides) would set them on the built configuration:
        # given to the constructor, the fields it derives follow them (where config.json
        # does not fix them)
        return cls.from_dict(dict(saved)), lambda **kw: cls.from_dict({**saved, **kw}), key
    cls = config_class(name, cfg, source)
    return cls(), cls, key


def model_config(cfg: Config, source: str, *, legacy: bool = False):
    """The transformers configuration model.args describes, overrides applied, its
    vocabulary and positions checked against the data (ConfigError naming the key).
    ``legacy``: the overrides set on the built configuration instead, as runs
    checkpointed before they went to the constructor were built (export reads those)."""
    args = cfg.model.args
    config, make, key = _base_config(cfg, source)
    overrides = dict(args.get("overrides") or {})
    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    for name in overrides:
        if not hasattr(config, name):
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise _error(cfg, source, f"model.args.overrides.{name}", (
                f"{type(config).__name__} has no field {name!r}"
                + (f"; did you mean {close[0]}?" if close else "")))
    vocab = data_vocab(cfg)
    if key == "config" and "vocab_size" not in overrides and hasattr(config, "vocab_size"):
        overrides["vocab_size"] = vocab
        for special in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(config, special, None)  # ids beyond the data's vocabulary
            if isinstance(value, int) and value >= vocab:
                overrides[special] = None
    training = {name: value for name, value in TRAINING_DEFAULTS.items()
                if hasattr(config, name) and name not in overrides}
    if legacy:
        for name, value in {**training, **overrides}.items():
            setattr(config, name, value)
        return config
    # through the constructor, as ConfigClass(**overrides): the fields it derives (Llama's
    # head_dim from hidden_size and the heads) follow the overrides, not the defaults
    try:
        config = make(**training, **overrides)
    except Exception as exc:  # transformers validates the fields: its own error types
        raise _error(cfg, source, "model.args.overrides", (
            f"{type(config).__name__} refuses them: {type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:300]}")) from None
    _check_fits_data(cfg, config, key, source)
    return config


def _check_fits_data(cfg: Config, config, key: str, source: str) -> None:
    vocab, have = data_vocab(cfg), getattr(config, "vocab_size", None)
    if isinstance(have, int) and have < vocab:
        where = "data.vocab_size" if cfg.data.kind != "text" else "model.args.overrides"
        raise _error(cfg, source, "model.args.overrides.vocab_size" if key == "config"
                          else f"model.args.{key}", (
                              f"the model has {have} token ids, the data {vocab} "
                              f"(data.kind={cfg.data.kind}): ids from {have} on would have no "
                              f"logit; make them agree ({where})"))
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions < cfg.model.context_length:
        raise _error(cfg, source, "model.context_length", (
            f"{cfg.model.context_length} tokens, but {type(config).__name__} takes at most "
            f"{positions} positions; lower it or raise the model's (model.args.overrides)"))


def check(cfg: Config, source: str) -> None:
    """The launcher's check: the configuration resolves, and the model builds from it on
    the meta device (no memory, no weights); its failure is one line naming the key."""
    config = model_config(cfg, source)
    import torch
    from transformers import AutoModelForCausalLM
    key = "model.args.overrides" if cfg.model.args.get("overrides") else (
        "model.args.pretrained" if cfg.model.args.get("pretrained") else "model.args.config")
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise _error(cfg, source, key, (
            f"no causal LM builds from this {type(config).__name__}: {type(exc).__name__}"
            + (f": {text[0][:200]}" if text else ""))) from None


def _error(cfg, source: str, key: str, problem: str) -> ConfigError:
    """The error about ``key``, naming where its value came from (file or command line)."""
    return ConfigError(source_of(cfg, key, source), key, problem)
