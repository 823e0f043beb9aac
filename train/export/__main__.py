"""``python -m train.export RUN_DIR [--out DIR] [--step N] [--safetensors] [--max-shard-size S]``
(``entrypoint.py export RUN_DIR``): the newest valid checkpoint's (or step-N's) model as
plain files usable without this trainer, and ``model.json`` describing them
(:mod:`train.export.writing`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train.core.errors import UserError
from train.core.run import rundir
from train.export.writing import export
from train.observe.trackers import upload_export


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
