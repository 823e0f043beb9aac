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
import tempfile
from pathlib import Path

from train.core import rundir
from train.core.files import create_new, sha256_file

# What an export writes; model.json lists them, and a later export replaces only these.
EXPORT_FILES = (rundir.EXPORT_WEIGHTS, rundir.EXPORT_META)
SAFETENSORS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
HF_FILES = ("config.json", "generation_config.json", SAFETENSORS, SHARD_INDEX)
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

    from train import safetensors_io
    tensors = {k: v.contiguous() for k, v in weights.items()}
    name = SAFETENSORS if safetensors else rundir.EXPORT_WEIGHTS
    write_replacing(out / name, (lambda f: safetensors_io.write(tensors, f)) if safetensors
                    else (lambda f: torch.save(tensors, f)))
    return name



def write_pretrained(out: Path, saved, weights: dict, max_shard_size: str | None,
                     source: str) -> list[str]:
    """A transformers model's save_pretrained files, written into a temporary folder in
    ``out``, each fsync'ed and renamed into place; their names."""
    from train import hf
    for left in out.glob(HF_TEMPORARY + "*"):  # an interrupted export's
        shutil.rmtree(left, ignore_errors=True)
    model = hf.rebuild(saved.config["model"], saved.model_io, source)
    with tempfile.TemporaryDirectory(dir=out, prefix=HF_TEMPORARY) as tmp:
        names = hf.save_pretrained(model, weights, Path(tmp), max_shard_size or
                                   hf.DEFAULT_SHARD_SIZE, saved.config["model"])
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
                f"{hf_class}; or train.export.load_model(<this folder>)")
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


