"""Reading an export back: the model rebuilt from ``model.json`` and loaded with the
exported weights, each file checked before the model is built (:func:`load_model`, the
API documented in docs/your-code.md)."""

from __future__ import annotations

import json
from pathlib import Path

from train.core.errors import CannotRunHere, ConfigError
from train.core.run import rundir
from train.export.layout import EXPORT_FILES, SAFETENSORS, SHARD_INDEX


def load_model(export_dir: str | Path):
    """The exported model, rebuilt and loaded, ready for inference (``model.eval()``):

        from train.export import load_model
        model = load_model("runs/quickstart/export")

    A custom model's factory must be importable (run from your project directory); a
    transformers model is rebuilt from the export's config.json instead. Weights that
    are damaged, hold more than tensors or do not fit model.json's model are refused
    (exit 2) before the model is built, as is a model larger than the memory left here
    (exit 3)."""
    import torch

    from train.core.config import ModelConfig
    from train.models import build_model
    export_dir = Path(export_dir)
    meta = json.loads((export_dir / rundir.EXPORT_META).read_text())
    io = meta.get("io") or {}

    def build():
        return build_model(ModelConfig(**meta["model"]),
                           input_shape=tuple(io.get("input_shape") or ()),
                           num_classes=io.get("num_classes") or 0, source=str(export_dir))

    if io.get("transformers"):
        from train.models import hf
        build = hf.from_export(export_dir, io["transformers"]) or build
    weights = read_export_weights(export_dir, meta)
    with torch.device("meta"):  # shapes only: nothing is allocated
        shapes = build()
    check_weights_fit(export_dir, shapes, weights, weights_file(meta))
    model = build()
    model.load_state_dict(weights, strict=False)  # checked: only tied copies are absent
    return model.eval()


def weights_file(meta: dict) -> str:
    files = meta.get("files") or list(EXPORT_FILES)
    return next((f for f in (rundir.EXPORT_WEIGHTS, SHARD_INDEX) if f in files), SAFETENSORS)


def read_export_weights(export_dir: Path, meta: dict) -> dict:
    """The weights of whichever files the export holds: model.pt, model.safetensors, or
    save_pretrained's shards (by their index)."""
    files = meta.get("files") or list(EXPORT_FILES)
    if rundir.EXPORT_WEIGHTS in files:
        return read_weights(export_dir / rundir.EXPORT_WEIGHTS)
    names = [SAFETENSORS]
    if SHARD_INDEX in files:
        try:
            index = json.loads((export_dir / SHARD_INDEX).read_text())["weight_map"]
            names = sorted(set(index.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError("command line", "RUN_DIR", (
                f"{export_dir / SHARD_INDEX}: unreadable ({type(exc).__name__}); "
                "export again")) from None
    weights = {}
    for name in names:
        weights.update(read_safetensors(export_dir / name))
    return weights


def read_safetensors(path: Path) -> dict:
    from train.export import safetensors_io
    try:
        return safetensors_io.read(path)
    except (OSError, safetensors_io.FormatError) as exc:
        raise ConfigError("command line", "RUN_DIR", (
            f"{path}: damaged or not a safetensors file ({first_line(exc)}); "
            "export again")) from None


def read_weights(path: Path) -> dict:
    """model.pt's tensors, mapped from the file rather than read into memory."""
    import pickle

    import torch
    problem = None
    try:
        weights = torch.load(path, weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        problem = ("holds objects other than tensors, which torch.load(weights_only=True) "
                   "refuses to unpickle" if "weights only" in str(exc).lower() else
                   f"not a torch.save file ({first_line(exc)})")
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        problem = f"damaged or not a torch.save file ({first_line(exc)})"
    else:
        if not (isinstance(weights, dict) and all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items())):
            problem = f"holds a {type(weights).__name__}, not a state dict of tensors"
    if problem:
        raise ConfigError("command line", "RUN_DIR", f"{path}: {problem}; export again")
    return weights


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def check_weights_fit(export_dir: Path, shapes, weights: dict, file: str) -> None:
    """model.pt must hold exactly the tensors model.json's model has, shape for shape,
    and the model must fit in the memory left here; checked on ``shapes``, the model
    built on the meta device."""
    from train.core.machine import host
    expected = shapes.state_dict()
    where = f"{export_dir / file} does not fit {export_dir / rundir.EXPORT_META}"
    missing = sorted(set(expected) - set(weights) - tied_copies(shapes, weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        name = (missing or extra)[0]
        raise ConfigError("command line", "RUN_DIR", (
            f"{where}: {name} is {f'missing from {file}' if missing else 'not in the model'} "
            f"({len(missing)} missing, {len(extra)} unexpected); export again"))
    for name, tensor in expected.items():
        if name in weights and tensor.shape != weights[name].shape:
            raise ConfigError("command line", "RUN_DIR", (
                f"{where}: {name} is {list(tensor.shape)} in the model, "
                f"{list(weights[name].shape)} in {file}; export again"))
    needed = sum(t.numel() * t.element_size()
                 for t in (*shapes.parameters(), *shapes.buffers()))
    left = host.available_memory()
    if left is not None and needed > left:
        raise CannotRunHere(f"{export_dir}: the model needs {needed / 2**20:.0f} MiB, "
                            f"{left / 2**20:.0f} MiB of memory is left here; free memory "
                            "or use a larger machine")


def tied_copies(model, weights: dict) -> set[str]:
    """Names of parameters shared with another name that ``weights`` holds (a tied
    output layer, which save_pretrained writes once)."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return {n for group in names.values() if len(group) > 1 and set(group) & set(weights)
            for n in group}
