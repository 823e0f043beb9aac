"""Writing an export: the newest valid checkpoint's (or step-N's) model as plain files
usable without this trainer, and ``model.json`` (model config, input shape, number of
classes or vocabulary, source checkpoint and step, SHA-256 of each weights file, the files
it wrote). The weights:

- ``model.pt``: a flat state dict of tensors, loadable with ``torch.load(...,
  weights_only=True)``; or with ``--safetensors``, ``model.safetensors`` (the same
  tensors, a format that holds no code: :mod:`train.export.safetensors_io`);
- a transformers model (``model.kind: hf``, or a factory returning a PreTrainedModel):
  what ``save_pretrained`` writes (config.json, generation_config.json, model.safetensors,
  or shards and model.safetensors.index.json above ``--max-shard-size``), so
  ``AutoModelForCausalLM.from_pretrained(DIR)`` loads it; with the tokenizer the run's
  token files were made with (:mod:`train.export.tokenizer`), for ``AutoTokenizer``.

Default output: ``RUN_DIR/export/``. Each file is written to a temporary name and
renamed, model.json last; an existing ``--out`` is replaced only when it is an earlier
export holding nothing else, and no folder is ever removed but the export's own
temporary one. The files' names and formats are :mod:`.layout`'s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from train.core.errors import CannotRunHere, ConfigError
from train.core.run import rundir
from train.export import tokenizer as export_tokenizer
from train.export.layout import (
    EXPORT_FILES,
    HF_TEMPORARY,
    SHARD_SIZE,
    describe,
    is_export_file,
    temporary_name,
    write_pretrained,
    write_replacing,
    write_weights,
)


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
