"""Hugging Face transformers models: ``model.kind: hf`` built, and any PreTrainedModel
written back in the layout ``from_pretrained`` reads.

The configuration comes from :mod:`train.core.config.hf_kind` (``model.args``: a config
class, model_type or directory, or a local pretrained directory, plus overrides); the
model is its ``AutoModelForCausalLM``. A pretrained directory is read with
``local_files_only``: nothing is ever downloaded, and the weights load in float32 (the
trainer's precision setting casts in autocast, as for every model).

:func:`save_pretrained` is the export's half: the trained weights loaded into the model
and ``model.save_pretrained`` (config.json, generation_config.json, model.safetensors, or
shards and their index above ``max_shard_size``), so any transformers user loads it with
``AutoModelForCausalLM.from_pretrained(folder)``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from train.core.config import ModelConfig
from train.core.config.hf_kind import TRAINING_DEFAULTS, model_config
from train.core.errors import ConfigError

TRANSFORMERS = "transformers"  # model_io's key: the PreTrainedModel's class

# save_pretrained's own default is 50GB; 5GB files are what the hub's tools expect.
DEFAULT_SHARD_SIZE = "5GB"


class _DataShape:
    """The few data.* values model_config reads, for a model rebuilt from an export."""

    def __init__(self, kind: str, vocab_size: int) -> None:
        self.kind, self.vocab_size = kind, vocab_size


class _Rebuild:
    """Enough of a Config for model_config: the model section and the data's vocabulary."""

    def __init__(self, model: ModelConfig, vocab: int) -> None:
        self.model = model
        self.data = _DataShape("tokens", vocab)


def build(cfg: ModelConfig, *, input_shape: tuple[int, ...], num_classes: int,
          source: str) -> nn.Module:
    """model.kind hf: num_classes is the data's vocabulary (the model's must cover it)."""
    from transformers import AutoModelForCausalLM
    config = model_config(_Rebuild(cfg, num_classes), source)
    pretrained = cfg.args.get("pretrained")
    if pretrained is None:
        return AutoModelForCausalLM.from_config(config)
    return _from_pretrained(pretrained, config, source)


def _from_pretrained(pretrained: str, config, source: str) -> nn.Module:
    """The pretrained weights; a folder whose weights cannot be read (a truncated or
    damaged safetensors file: its header is checked, its bytes are not, the format
    carries no checksum) is one line naming it, exit 2."""
    from transformers import AutoModelForCausalLM
    try:
        return AutoModelForCausalLM.from_pretrained(pretrained, config=config,
                                                    local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError, *_weights_errors()) as exc:
        raise ConfigError(source, "model.args.pretrained", (
            f"{pretrained}: from_pretrained failed: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}")) from None


def _weights_errors() -> tuple[type[Exception], ...]:
    """What reading a damaged weights file raises besides OSError and ValueError."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return ()
    return (SafetensorError,)


def is_pretrained_model(model: nn.Module) -> bool:
    """A transformers PreTrainedModel (only asked when transformers is already loaded:
    a model that is none never imports it)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def model_io(model: nn.Module) -> dict[str, str]:
    """What a checkpoint records for export: ``{"transformers": class name}`` for a
    PreTrainedModel (under DDP or DataParallel: the model inside), else nothing."""
    inner = model.module if isinstance(model, (nn.parallel.DistributedDataParallel,
                                               nn.DataParallel)) else model
    if not is_pretrained_model(inner):
        return {}
    from torch.distributed.fsdp import FSDPModule
    # FSDP2 and activation checkpointing swap in subclasses of the model's own class
    own = next(cls for cls in type(inner).__mro__
               if "_wrapped_class" not in vars(cls) and not issubclass(cls, FSDPModule))
    return {TRANSFORMERS: own.__name__}


def save_pretrained(model: nn.Module, weights: dict | None, folder: Path, max_shard_size: str,
                    model_section: dict, special_ids: dict | None = None) -> list[str]:
    """``weights`` loaded into ``model`` (None: loaded already) and saved with
    ``save_pretrained``; the names of the files written. For model.kind hf, the
    training-only settings this project chose (no key/value cache) go back to the class's
    default unless the user's overrides set them; a factory's model is saved as the
    factory configured it. The generation config never turns the cache off (``generate``
    would recompute every position).
    ``special_ids`` (bos/eos/pad_token_id of the run's tokenizer) replace the
    configuration's, except those model.args.overrides sets."""
    if weights is not None:
        model.load_state_dict(weights)
    overrides = {}
    if model_section.get("kind") == "hf":
        overrides = (model_section.get("args") or {}).get("overrides") or {}
        defaults = type(model.config)()
        for name in TRAINING_DEFAULTS:
            if name not in overrides and hasattr(defaults, name):
                setattr(model.config, name, getattr(defaults, name))
    for name, value in (special_ids or {}).items():
        if name not in overrides:
            setattr(model.config, name, value)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        for name in special_ids or {}:
            setattr(generation, name, getattr(model.config, name))
        generation.use_cache = True
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # export prints what it wrote, in one line
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return sorted(p.name for p in folder.iterdir())


def rebuild(model: dict, io: dict, source: str, *, legacy: bool = False) -> nn.Module:
    """The trained model's architecture, to load its weights into: model.kind hf from its
    configuration alone (a pretrained directory's config.json, not its weights); a
    factory's model through the factory. ``legacy``: model.kind hf as runs checkpointed
    before the overrides went to the configuration's constructor built it."""
    from train.models import build_model
    cfg = ModelConfig(**model)
    if cfg.kind != "hf":
        return build_model(cfg, input_shape=tuple(io.get("input_shape") or ()),
                           num_classes=io.get("num_classes") or 0, source=source)
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(model_config(_Rebuild(cfg, io["num_classes"]),
                                                         source, legacy=legacy))


def from_export(folder: Path, class_name: str):
    """A builder of the exported architecture from the export's own config.json (no
    factory, no pretrained directory needed), or None when the class is not one of
    transformers' (the user's own subclass: rebuilt through the factory)."""
    import transformers
    cls = getattr(transformers, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        return None
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    return lambda: cls._from_config(config)
