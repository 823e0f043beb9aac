"""The files an export writes, and how: model.pt, model.safetensors, or a transformers
model's save_pretrained layout, and model.json describing them (``train.export``).

Every file is written beside its final name (or, for save_pretrained, into a temporary
folder inside the output), fsync'ed and renamed over it; model.json comes last and
lists the files and the SHA-256 of each weights file, so a later export replaces exactly
these and a torn set is told apart.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from train.core.errors import ConfigError
from train.core.files import create_new, sha256_file
from train.core.run import rundir
from train.export.tokenizer import TOKENIZER_FILES

# What an export writes; model.json lists them, and a later export replaces only these.
EXPORT_FILES = (rundir.EXPORT_WEIGHTS, rundir.EXPORT_META)
SAFETENSORS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
HF_FILES = ("config.json", "generation_config.json", SAFETENSORS, SHARD_INDEX,
            *TOKENIZER_FILES)
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
SHARD_SIZE = re.compile(r"[1-9][0-9]*([KMGT]i?B)?", re.IGNORECASE)  # save_pretrained's sizes
HF_TEMPORARY = ".hf-export-"  # save_pretrained's folder inside the output, then renamed


def is_export_file(name: str) -> bool:
    return name in EXPORT_FILES or name in HF_FILES or SHARD.fullmatch(name) is not None



def temporary_name(name: str) -> str:
    return f".{name}.tmp"



def write_weights(out: Path, weights: dict, safetensors: bool) -> str:
    """model.pt, or model.safetensors; the file's name."""
    import torch

    from train.export import safetensors_io
    tensors = {k: v.contiguous() for k, v in weights.items()}
    name = SAFETENSORS if safetensors else rundir.EXPORT_WEIGHTS
    write_replacing(out / name, (lambda f: safetensors_io.write(tensors, f)) if safetensors
                    else (lambda f: torch.save(tensors, f)))
    return name



def write_pretrained(out: Path, saved, weights: dict, max_shard_size: str | None,
                     source: str, tokenizer=None) -> list[str]:
    """A transformers model's save_pretrained files, and the run's tokenizer's when it
    has one (:mod:`train.export.tokenizer`, whose special tokens' ids the configuration
    takes), written into a temporary folder in ``out``, each fsync'ed and renamed into
    place; their names."""
    from train.models import hf
    for left in out.glob(HF_TEMPORARY + "*"):  # an interrupted export's
        shutil.rmtree(left, ignore_errors=True)
    model = trained_model(saved, weights, source)
    with tempfile.TemporaryDirectory(dir=out, prefix=HF_TEMPORARY) as tmp:
        names = hf.save_pretrained(model, None, Path(tmp), max_shard_size or
                                   hf.DEFAULT_SHARD_SIZE, saved.config["model"],
                                   tokenizer.special_ids() if tokenizer else None)
        if tokenizer:
            names = sorted({*names, *tokenizer.write(Path(tmp))})
        umask = os.umask(0)
        os.umask(umask)
        for name in names:
            with open(Path(tmp) / name, "rb") as f:
                os.fsync(f.fileno())
            # transformers writes some of them private (a temporary file renamed): give
            # them the mode every other file of the export has
            os.chmod(Path(tmp) / name, 0o666 & ~umask)
            os.replace(Path(tmp) / name, out / name)
    return names



def trained_model(saved, weights: dict, source: str):
    """The checkpoint's transformers model, its weights loaded. A model.kind hf run
    checkpointed before the overrides went to the configuration's constructor kept the
    fields it derives from the defaults (Llama's head_dim): rebuilt so when the weights
    say it was, with a warning."""
    from train.models import hf
    section = saved.config["model"]
    model = hf.rebuild(section, saved.model_io, source)
    try:
        model.load_state_dict(weights)
        return model
    except RuntimeError as exc:
        if section.get("kind") != "hf" or "size mismatch" not in str(exc):
            raise
        problem = " ".join(str(exc).split())[:300]
    model = hf.rebuild(section, saved.model_io, source, legacy=True)
    try:
        model.load_state_dict(weights)
    except RuntimeError:
        raise ConfigError("command line", "RUN_DIR", (
            f"the checkpoint's weights do not fit the model its config builds: "
            f"{problem}")) from None
    name, head_dim = type(model.config).__name__, getattr(model.config, "head_dim", None)
    print(f"warning: this run's {name} was built before model.args.overrides went to its "
          "constructor: exported as it was trained, the fields it derives left at the "
          f"defaults'{f' (head_dim {head_dim})' if head_dim is not None else ''}; a new run "
          f"of this config builds {name}(**overrides)", file=sys.stderr)
    return model


def describe(saved, path: Path, out: Path, written: list[str], hf_class: str | None) -> dict:
    """model.json: what the model is, where it came from, and how to load it."""
    from train.core.config.kinds import DATA_KINDS, MODEL_KINDS
    config = saved.config
    model = config["model"]
    kind = MODEL_KINDS.get(model.get("kind"))
    recorded = {"kind": model.get("kind"), **{k: model[k] for k in (kind.keys if kind else model)
                                              if k in model and k != "kind"}}
    data_kind = DATA_KINDS.get((config.get("data") or {}).get("kind"))
    weights = [n for n in written if n.endswith((".pt", ".safetensors"))]
    meta = {"model": recorded, "io": saved.model_io,
            "causal_lm": bool((kind and kind.tokens) or (data_kind and data_kind.name in
                                                         ("text", "tokens"))),
            "checkpoint": str(path), "step": saved.step,
            "sha256": {n: sha256_file(out / n) for n in weights},
            "load": how_to_load(model, written, hf_class), "files": [*written, rundir.EXPORT_META]}
    if rundir.EXPORT_WEIGHTS in written:
        meta["model_pt_sha256"] = meta["sha256"][rundir.EXPORT_WEIGHTS]
    return meta



def how_to_load(model: dict, written: list[str], hf_class: str | None) -> str:
    if hf_class:
        return (f"transformers.AutoModelForCausalLM.from_pretrained(<this folder>) -> "
                f"{hf_class}; or train.export.load_model(<this folder>)"
                + ("; transformers.AutoTokenizer.from_pretrained(<this folder>)"
                   if TOKENIZER_FILES[0] in written else ""))
    read = ("torch.load('model.pt', weights_only=True)" if rundir.EXPORT_WEIGHTS in written
            else "safetensors.torch.load_file('model.safetensors')")
    return (f"{read} -> state dict of "
            + (f"{model['factory']}(**model['args']) (your factory)"
               if model.get("kind") == "custom" else
               "train.models.build_model(ModelConfig(**model), input_shape=tuple(io["
               "'input_shape']), num_classes=io['num_classes'])"))



def write_replacing(path: Path, write) -> None:
    tmp = path.with_name(temporary_name(path.name))
    with create_new(tmp) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


