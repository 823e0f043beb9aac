"""``python -m train.export RUN_DIR [--out DIR] [--step N] [--safetensors] [--max-shard-size S]``
(``entrypoint.py export RUN_DIR``).

Writes the newest valid checkpoint's (or step-N's) model as plain files usable without this
trainer, and ``model.json`` (model config, input shape, number of classes or vocabulary,
source checkpoint and step, SHA-256 of each weights file, the files it wrote). The weights:

- ``model.pt``: a flat state dict of tensors, loadable with ``torch.load(...,
  weights_only=True)``; or with ``--safetensors``, ``model.safetensors`` (the same
  tensors, a format that holds no code: :mod:`train.safetensors_io`);
- a transformers model (``model.kind: hf``, or a factory returning a PreTrainedModel):
  what ``save_pretrained`` writes (config.json, generation_config.json, model.safetensors,
  or shards and model.safetensors.index.json above ``--max-shard-size``), so
  ``AutoModelForCausalLM.from_pretrained(DIR)`` loads it; with the tokenizer the run's
  token files were made with (:mod:`train.export_tokenizer`), for ``AutoTokenizer``.

Default output: ``RUN_DIR/export/``. Each file is written to a temporary name and
renamed, model.json last; an existing ``--out`` is replaced only when it is an earlier
export holding nothing else, and no folder is ever removed but the export's own
temporary one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train import export_tokenizer
from train.core import rundir
from train.core.errors import CannotRunHere, ConfigError, UserError
from train.export_layout import (
    EXPORT_FILES,
    HF_TEMPORARY,
    SAFETENSORS,
    SHARD_INDEX,
    SHARD_SIZE,
    describe,
    is_export_file,
    temporary_name,
    write_pretrained,
    write_replacing,
    write_weights,
)
from train.observe.trackers import upload_export


def check_output(run_dir: Path, out: Path) -> None:
    """The output must be new, or an earlier export holding nothing but the files it
    wrote (its model.json lists them), and must not hold or sit inside the run's own
    files (except RUN_DIR/export itself). Nothing is ever removed but those files."""
    run, target = run_dir.resolve(), out.resolve()
    if target == run or target in run.parents:
        raise ConfigError("command line", "--out", f"{out} contains the run directory; "
                                                   f"choose a new or an earlier export directory")
    if run in target.parents and target.relative_to(run).parts[0] != rundir.EXPORT:
        raise ConfigError("command line", "--out", f"{out} is inside the run's own files; use "
                                                   f"{run_dir / rundir.EXPORT} or a path outside")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError("command line", "--out", f"{out} exists and is not a directory; "
                                                   "choose a new or an earlier export directory")
    if not out.exists():
        return
    if not (out / rundir.EXPORT_META).is_file():
        raise ConfigError("command line", "--out", f"{out} exists and is not an earlier export "
                                                   f"(no model.json); it would be replaced")
    listed = listed_files(out / rundir.EXPORT_META)
    ours = {*listed, *(temporary_name(f) for f in listed)}  # an interrupted export's too
    foreign = sorted(p.name for p in out.iterdir()
                     if p.name not in ours and not p.name.startswith(HF_TEMPORARY))
    if foreign:
        raise ConfigError("command line", "--out",
                          f"{out} holds files an export did not write "
                          f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                          "export replaces only its own files: choose another --out")


def listed_files(meta_path: Path) -> list[str]:
    """The files an earlier export wrote (exports before the list existed wrote these)."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        files = meta.get("files") if isinstance(meta, dict) else None
    except (OSError, ValueError):
        files = None
    listed = files if isinstance(files, list) and all(isinstance(f, str) for f in files) \
        else EXPORT_FILES
    return [f for f in listed if is_export_file(f)]


def _no_such_step(checkpoints: Path) -> str:
    """Why --step N found nothing, with the steps the run has checkpoints of."""
    steps = sorted(rundir.step_of(p) for p in rundir.step_dirs(checkpoints))
    if not steps:
        return "no such checkpoint; this run has none yet"
    shown = ", ".join(map(str, steps[-20:]))
    return f"no such checkpoint; this run has steps {'..., ' if len(steps) > 20 else ''}{shown}"


def load_checkpoint(run_dir: Path, step: int | None) -> tuple[Path, dict]:
    """The newest checkpoint that verifies and loads, or step-N when asked for."""
    from train.checkpoint import reader
    checkpoints = run_dir / rundir.CHECKPOINTS
    if step is not None:
        path = checkpoints / rundir.step_name(step)
        problem = reader.verify(path) if path.is_dir() else _no_such_step(checkpoints)
        if problem:
            raise ConfigError("command line", "--step", f"{path}: {problem}")
        return path, reader.load(path, 0)[0]
    try:
        found = reader.newest_loadable(checkpoints, rank=0)
    except reader.CheckpointsUnusable as exc:
        raise ConfigError("command line", "RUN_DIR", str(exc)) from None
    if found is None:
        raise CannotRunHere(f"{run_dir}: no valid checkpoint under checkpoints/; train first")
    return found[0], found[1]


def non_finite(model: dict) -> list[str]:
    """Names of the tensors holding NaN or infinity."""
    import torch
    return [k for k, v in model.items() if v.is_floating_point() and not torch.isfinite(v).all()]


def export(run_dir: Path, out: Path, step: int | None = None, *, safetensors: bool = False,
           max_shard_size: str | None = None) -> Path:
    from train.checkpoint.state import Restored

    if not run_dir.is_dir():
        raise ConfigError("command line", "RUN_DIR", f"{run_dir}: not a directory")
    path, shared = load_checkpoint(run_dir, step)
    saved = Restored(shared)
    weights = saved.model
    if saved.sharded:  # consolidated here, in this process alone: no process group
        from train.checkpoint import sharded
        weights = sharded.full_model_state(path / rundir.SHARDS)
    bad = non_finite(weights)
    if bad:  # a checkpoint of a diverged run (written before the divergence guard)
        raise ConfigError("command line", "RUN_DIR", f"{path} holds non-finite weights "
                                                     f"({', '.join(bad[:3])}); export an "
                                                     "earlier checkpoint with --step N")
    hf_class = (saved.model_io or {}).get("transformers")
    if max_shard_size is not None and not hf_class:
        raise ConfigError("command line", "--max-shard-size", "only for a transformers model "
                                                               "(its save_pretrained shards)")
    if max_shard_size is not None and not SHARD_SIZE.fullmatch(max_shard_size):
        raise ConfigError("command line", "--max-shard-size", f"{max_shard_size}: expected a "
                                                               "size such as 5GB, 500MB or 100KB")
    check_output(run_dir, out)
    out.mkdir(parents=True, exist_ok=True)
    previous = listed_files(out / rundir.EXPORT_META) if (out / rundir.EXPORT_META).is_file() \
        else []
    # Each file is written beside its final name and renamed over it, model.json last:
    # its hashes of the weights tell a torn set apart. Nothing else in `out` is touched.
    tokenizer = None
    if hf_class:
        tokenizer, why_not = export_tokenizer.locate(saved.config, run_dir)
        if why_not:
            print(f"warning: the export carries no tokenizer: {why_not}", file=sys.stderr)
        written = write_pretrained(out, saved, weights, max_shard_size, str(run_dir), tokenizer)
    else:
        written = [write_weights(out, weights, safetensors)]
    meta = describe(saved, path, out, written, hf_class)
    if tokenizer:
        meta["tokenizer"] = tokenizer.describe()
    text = (json.dumps(meta, indent=2) + "\n").encode()
    write_replacing(out / rundir.EXPORT_META, lambda f: f.write(text))
    for name in set(previous) - set(meta["files"]):  # an earlier export's, replaced
        (out / name).unlink(missing_ok=True)
    return out


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
        from train import hf
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
    from train import safetensors_io
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
    from train.core import host
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (output.dir/run.name)")
    parser.add_argument("--out", type=Path, help="output directory (default RUN_DIR/export)")
    parser.add_argument("--step", type=int, help="export checkpoints/step-N instead of the newest")
    parser.add_argument("--safetensors", action="store_true",
                        help="weights as model.safetensors instead of model.pt (a transformers "
                             "model is always written as save_pretrained writes it)")
    parser.add_argument("--max-shard-size", metavar="SIZE",
                        help="a transformers model: shard its safetensors above SIZE "
                             "(save_pretrained's max_shard_size: 5GB, 500MB, ...; default 5GB)")
    args = parser.parse_args(argv)
    try:
        out = export(args.run_dir, args.out or args.run_dir / rundir.EXPORT, args.step,
                     safetensors=args.safetensors, max_shard_size=args.max_shard_size)
    except UserError as exc:
        print(exc.one_line(), file=sys.stderr)
        return exc.exit_code
    files = json.loads((out / rundir.EXPORT_META).read_text())["files"]
    print(f"exported {', '.join(f'{out}/{name}' for name in files)}")
    uploaded = upload_export(args.run_dir, out)
    if uploaded:
        print(uploaded, file=sys.stderr if uploaded.startswith("warning") else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
