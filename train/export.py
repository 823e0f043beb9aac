"""``python -m train.export RUN_DIR [--out DIR] [--step N]`` (``entrypoint.py export RUN_DIR``).

Writes the newest valid checkpoint's (or step-N's) model as plain files usable without this trainer:
``model.pt`` (a flat state dict of tensors, loadable with ``torch.load(...,
weights_only=True)``) and ``model.json`` (model config, input shape, number of classes
or vocabulary, source checkpoint and step, SHA-256 of model.pt, the files it wrote).
Default output: ``RUN_DIR/export/``. Each file is written to a temporary name and
renamed; an existing ``--out`` is replaced only when it is an earlier export holding
nothing else, and no folder is ever removed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from train.core import rundir
from train.core.errors import CannotRunHere, ConfigError, UserError
from train.core.files import create_new, sha256_file
from train.observe.trackers import upload_export

# What an export writes; model.json lists them, and a later export replaces only these.
EXPORT_FILES = (rundir.EXPORT_WEIGHTS, rundir.EXPORT_META)


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
    foreign = sorted(p.name for p in out.iterdir() if p.name not in ours)
    if foreign:
        raise ConfigError("command line", "--out",
                          f"{out} holds files an export did not write "
                          f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                          "export replaces only its own files: choose another --out")


def temporary_name(name: str) -> str:
    return f".{name}.tmp"


def listed_files(meta_path: Path) -> list[str]:
    """The files an earlier export wrote (exports before the list existed wrote these)."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        files = meta.get("files") if isinstance(meta, dict) else None
    except (OSError, ValueError):
        files = None
    listed = files if isinstance(files, list) and all(isinstance(f, str) for f in files) \
        else EXPORT_FILES
    return [f for f in listed if f in EXPORT_FILES]


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


def export(run_dir: Path, out: Path, step: int | None = None) -> Path:
    import torch

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
    check_output(run_dir, out)
    out.mkdir(parents=True, exist_ok=True)
    # Each file is written beside its final name and renamed over it, model.json last:
    # its hash of model.pt tells a torn pair apart. Nothing else in `out` is touched.
    write_replacing(out / rundir.EXPORT_WEIGHTS, lambda f: torch.save(
        {k: v.contiguous() for k, v in weights.items()}, f))
    model = saved.config["model"]
    load = ("torch.load('model.pt', weights_only=True) -> state dict of "
            + (f"{model['factory']}(**model['args']) (your factory)"
               if model.get("kind") == "custom" else
               "train.models.build_model(ModelConfig(**model), input_shape=tuple(io["
               "'input_shape']), num_classes=io['num_classes'])"))
    meta = {"model": model, "io": saved.model_io, "checkpoint": str(path), "step": saved.step,
            "model_pt_sha256": sha256_file(out / rundir.EXPORT_WEIGHTS), "load": load,
            "files": list(EXPORT_FILES)}
    text = (json.dumps(meta, indent=2) + "\n").encode()
    write_replacing(out / rundir.EXPORT_META, lambda f: f.write(text))
    return out


def write_replacing(path: Path, write) -> None:
    tmp = path.with_name(temporary_name(path.name))
    with create_new(tmp) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_model(export_dir: str | Path):
    """The exported model, rebuilt and loaded, ready for inference (``model.eval()``):

        from train.export import load_model
        model = load_model("runs/quickstart/export")

    A custom model's factory must be importable (run from your project directory).
    A model.pt that is damaged, holds more than tensors or does not fit model.json's
    model is refused (exit 2) before the model is built, as is a model larger than the
    memory left here (exit 3)."""
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

    weights = read_weights(export_dir / rundir.EXPORT_WEIGHTS)
    with torch.device("meta"):  # shapes only: nothing is allocated
        shapes = build()
    check_weights_fit(export_dir, shapes, weights)
    model = build()
    model.load_state_dict(weights)
    return model.eval()


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


def check_weights_fit(export_dir: Path, shapes, weights: dict) -> None:
    """model.pt must hold exactly the tensors model.json's model has, shape for shape,
    and the model must fit in the memory left here; checked on ``shapes``, the model
    built on the meta device."""
    from train.core import host
    expected = shapes.state_dict()
    where = f"{export_dir / rundir.EXPORT_WEIGHTS} does not fit {export_dir / rundir.EXPORT_META}"
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        name = (missing or extra)[0]
        raise ConfigError("command line", "RUN_DIR", (
            f"{where}: {name} is {'missing from model.pt' if missing else 'not in the model'} "
            f"({len(missing)} missing, {len(extra)} unexpected); export again"))
    for name, tensor in expected.items():
        if tensor.shape != weights[name].shape:
            raise ConfigError("command line", "RUN_DIR", (
                f"{where}: {name} is {list(tensor.shape)} in the model, "
                f"{list(weights[name].shape)} in model.pt; export again"))
    needed = sum(t.numel() * t.element_size()
                 for t in (*shapes.parameters(), *shapes.buffers()))
    left = host.available_memory()
    if left is not None and needed > left:
        raise CannotRunHere(f"{export_dir}: the model needs {needed / 2**20:.0f} MiB, "
                            f"{left / 2**20:.0f} MiB of memory is left here; free memory "
                            "or use a larger machine")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (output.dir/run.name)")
    parser.add_argument("--out", type=Path, help="output directory (default RUN_DIR/export)")
    parser.add_argument("--step", type=int, help="export checkpoints/step-N instead of the newest")
    args = parser.parse_args(argv)
    try:
        out = export(args.run_dir, args.out or args.run_dir / rundir.EXPORT, args.step)
    except UserError as exc:
        print(exc.one_line(), file=sys.stderr)
        return exc.exit_code
    print(f"exported {out}/model.pt and {out}/model.json")
    uploaded = upload_export(args.run_dir, out)
    if uploaded:
        print(uploaded, file=sys.stderr if uploaded.startswith("warning") else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
