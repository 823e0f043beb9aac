"""Start-up with a large token file: command -> first training step with a 1 GiB
``data.kind: tokens`` file against the same run with a 1 MiB one (issue: nothing on the
launcher's critical path may grow with the data; goal: within 1 s on a warm page cache).

The launcher checks every id of a token file against ``data.vocab_size`` before any
worker starts (train/core/datasets/tokenscan.py); the scan's result is kept in the run directory,
so the workers skip it and so does every later start. Three kinds of start, in
alternating rounds, 2 processes (gloo, 127.0.0.1), both files read once beforehand so
the page cache holds them: the 1 MiB file; the 1 GiB file in a new run (the launcher
scans it once); the 1 GiB file in a run whose directory holds the scan's record (a
restart). A first round is run and left out (imports, caches). Then, measured in this
process, each part of a start that grows with the file: the scan, the record's check,
the manifest's sampled hash, and the permutation of all windows (the global order's,
which every rank computes: a cost of the full shuffle, in windows, not bytes).

    python -m bench.tokenscan [--rounds 3] [--gib 1] [--context 1024]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
FIRST_STEP = "step 1/"


def write_tokens(path: Path, size: int, vocab: int) -> None:
    """``size`` bytes of ids below ``vocab``, written in 64 MiB pieces."""
    rng = np.random.default_rng(0)
    piece = rng.integers(0, vocab, size=min(size, 64 << 20) // 2, dtype=np.uint16)
    with path.open("wb") as f:
        left = size
        while left > 0:
            f.write(piece.tobytes()[:left])
            left -= piece.nbytes


def config(workdir: Path, data: Path, vocab: int, context: int) -> Path:
    tree = {"seed": 0, "model": {"kind": "gpt", "depth": 1, "width": 32, "heads": 2,
                                 "context_length": context},
            "data": {"kind": "tokens", "path": str(data), "vocab_size": vocab,
                     "num_workers": 0},
            "train": {"max_steps": 1, "global_batch_size": 8, "eval_batches": 0},
            "logging": {"every_steps": 1, "progress": "plain"},
            "output": {"dir": str(workdir / "runs")}}
    path = workdir / f"{data.stem}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def first_step(cfg: Path, run_name: str, env: dict) -> float:
    """Seconds from the command to its first (and only) step's line; the run then ends
    as usual (its end is not timed)."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(ROOT / "entrypoint.py"), "train", str(cfg),
                             f"run.name={run_name}", "distributed.nproc_per_node=2"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    took, said = None, []
    for line in proc.stdout:
        said.append(line)
        if took is None and FIRST_STEP in line:
            took = time.monotonic() - start
    proc.wait()
    proc.stdout.close()
    if took is None or proc.returncode:
        sys.exit(f"no {FIRST_STEP!r} from {cfg} (exit {proc.returncode}):\n"
                 + "".join(said[-30:]))
    return took


def data_costs(path: Path, context: int) -> dict[str, float]:
    """Seconds of each part of a start that grows with the file, in this process: the
    launcher's scan (a new run only), the identity a restart checks the record with, the
    manifest's sampled hash, and the permutation of the windows every rank computes."""
    from train.core.datasets.tokenscan import fingerprint, scan
    from train.data.builders import _file_hash
    from train.data.order import GlobalOrder
    windows = (path.stat().st_size // 2 - 1) // context
    parts = {"scan (new run, launcher)": lambda: scan(path),
             "record check (fingerprint)": lambda: fingerprint(path),
             "manifest hash (each rank)": lambda: _file_hash(path),
             f"permutation of {windows:,} windows (each rank)":
                 lambda: GlobalOrder(windows, 0).permutation(0)}
    out = {}
    for name, part in parts.items():
        start = time.monotonic()
        part()
        out[name] = time.monotonic() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--context", type=int, default=1024, help="model.context_length "
                        "(gpt-small's; the windows to permute are the tokens / this)")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    vocab = 50304
    small, big, restart = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        small_file, big_file = work / "small.bin", work / "big.bin"
        write_tokens(small_file, 1 << 20, vocab)
        write_tokens(big_file, int(args.gib * (1 << 30)), vocab)
        costs = data_costs(big_file, args.context)  # also warms the page cache
        small_cfg, big_cfg = (config(work, f, vocab, args.context) for f in (small_file,
                                                                            big_file))
        first_step(small_cfg, "warm-up", env)
        for r in range(args.rounds):
            small.append(first_step(small_cfg, f"small-{r}", env))
            big.append(first_step(big_cfg, f"big-{r}", env))
            again = work / "runs" / f"again-{r}"
            again.mkdir(parents=True)  # a restart: the run directory holds the record
            shutil.copy(work / "runs" / f"big-{r}" / "token-ids.json", again)
            restart.append(first_step(big_cfg, f"again-{r}", env))
    s, b, a = (statistics.median(x) for x in (small, big, restart))
    print(f"command -> first step, 2 processes, medians of {args.rounds} rounds, warm page "
          "cache:")
    print(f"  1 MiB token file                       {s:6.2f} s")
    print(f"  {args.gib:g} GiB, new run (launcher scans once)    {b:6.2f} s  ({b - s:+.2f})")
    print(f"  {args.gib:g} GiB, restart (scan recorded)         {a:6.2f} s  ({a - s:+.2f})")
    print(f"  what grows with the file, in this process (model.context_length={args.context}):")
    for name, seconds in costs.items():
        print(f"    {name:44s}{seconds:6.2f} s")
    print(f"difference {args.gib:g} GiB - 1 MiB: new run {b - s:+.2f} s, restart "
          f"{a - s:+.2f} s (goal: within 1 s)")


if __name__ == "__main__":
    main()
