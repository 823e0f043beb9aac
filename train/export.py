"""``python -m train.export RUN_DIR [--out DIR]`` (``entrypoint.py export RUN_DIR``).

Writes the newest valid checkpoint's model as plain files usable without this trainer:
``model.pt`` (a flat state dict of tensors, loadable with ``torch.load(...,
weights_only=True)``) and ``model.json`` (model config, input shape, number of classes
or vocabulary, source checkpoint and step, SHA-256 of model.pt). Default output:
``RUN_DIR/export/``, written to a temporary name and renamed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from train.errors import CannotRunHere, ConfigError, UserError
from train.files import sha256_file


def check_output(run_dir: Path, out: Path) -> None:
    """The output is replaced, so it must be an earlier export or not exist, and must not
    hold or sit inside the run's own files (except RUN_DIR/export itself)."""
    run, target = run_dir.resolve(), out.resolve()
    if target == run or target in run.parents:
        raise ConfigError("command line", "--out", f"{out} contains the run directory; "
                                                   f"choose a new or an earlier export directory")
    if run in target.parents and target.relative_to(run).parts[0] != "export":
        raise ConfigError("command line", "--out", f"{out} is inside the run's own files; "
                                                   f"use {run_dir / 'export'} or a path outside")
    if target.exists() and not (target.is_dir() and (target / "model.json").is_file()):
        raise ConfigError("command line", "--out", f"{out} exists and is not an earlier export "
                                                   f"(no model.json); it would be replaced")


def export(run_dir: Path, out: Path) -> Path:
    import torch

    from train.checkpoint import Checkpointer
    from train.state import Restored

    if not run_dir.is_dir():
        raise ConfigError("command line", "RUN_DIR", f"{run_dir}: not a directory")
    found = Checkpointer(run_dir, rank=0, keep_last=1).load_newest(rank=0)
    if found is None:
        raise CannotRunHere(f"{run_dir}: no valid checkpoint under checkpoints/; train first")
    path, shared, _ = found
    saved = Restored(shared)
    check_output(run_dir, out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save({k: v.contiguous() for k, v in saved.model.items()}, tmp / "model.pt")
    digest = sha256_file(tmp / "model.pt")
    meta = {"model": saved.config["model"], "io": saved.model_io,
            "checkpoint": str(path), "step": saved.step, "model_pt_sha256": digest,
            "load": "torch.load('model.pt', weights_only=True) -> state dict of "
                    "train.models.build_model(ModelConfig(**model), input_shape=..., "
                    "num_classes=...)"}
    (tmp / "model.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (output.dir/run.name)")
    parser.add_argument("--out", type=Path, help="output directory (default RUN_DIR/export)")
    args = parser.parse_args(argv)
    try:
        out = export(args.run_dir, args.out or args.run_dir / "export")
    except UserError as exc:
        print(exc.one_line(), file=sys.stderr)
        return exc.exit_code
    print(f"exported {out}/model.pt and {out}/model.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
