"""Start-up with a large token file: command -> first training step with a 1 GiB
``data.kind: tokens`` file against the same run with a 1 MiB one (issue: nothing on the
launcher's critical path may grow with the data; goal: within 1 s on a warm page cache).

The launcher checks every id of a token file against ``data.vocab_size`` before any
worker starts (train/core/tokenscan.py); the scan's result is kept in the run directory,
so the workers skip it and so does every later start. Three kinds of start, in
alternating rounds, 2 processes (gloo, 127.0.0.1), both files read once beforehand so
the page cache holds them: the 1 MiB file; the 1 GiB file in a new run (the launcher
scans it once); the 1 GiB file in a run whose directory holds the scan's record (a
restart). A first round is run and left out (imports, caches). Also the scan alone, in
this process.

    python -m bench.tokenscan [--rounds 3] [--gib 1]
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


def config(workdir: Path, data: Path, vocab: int) -> Path:
    tree = {"seed": 0, "model": {"kind": "gpt", "depth": 1, "width": 32, "heads": 2,
                                 "context_length": 64},
            "data": {"kind": "tokens", "path": str(data), "vocab_size": vocab,
                     "num_workers": 0},
            "train": {"max_steps": 1000, "global_batch_size": 8, "eval_batches": 0},
            "logging": {"every_steps": 1, "progress": "plain"},
            "output": {"dir": str(workdir / "runs")}}
    path = workdir / f"{data.stem}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def first_step(cfg: Path, run_name: str, env: dict) -> float:
    """Seconds from the command to its first step's line; then the run is stopped."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(ROOT / "entrypoint.py"), "train", str(cfg),
                             f"run.name={run_name}", "distributed.nproc_per_node=2"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    took = None
    for line in proc.stdout:
        if FIRST_STEP in line:
            took = time.monotonic() - start
            break
    os.killpg(proc.pid, 9)  # the launcher, torchrun and the workers: this bench's own group
    proc.wait()
    proc.stdout.close()
    if took is None:
        sys.exit(f"no {FIRST_STEP!r} from {cfg}")
    return took


def scan_alone(path: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of the check's scan of ``path``, in this process."""
    from train.core.tokenscan import scan
    cpu, wall = time.process_time(), time.monotonic()
    scan(path)
    return time.process_time() - cpu, time.monotonic() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gib", type=float, default=1.0)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    vocab = 50304
    small, big, restart = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        small_file, big_file = work / "small.bin", work / "big.bin"
        write_tokens(small_file, 1 << 20, vocab)
        write_tokens(big_file, int(args.gib * (1 << 30)), vocab)
        scanned = scan_alone(big_file)  # also warms the page cache
        small_cfg, big_cfg = config(work, small_file, vocab), config(work, big_file, vocab)
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
    print(f"  the scan alone, in this process: {scanned[0]:.2f} CPU-s, {scanned[1]:.2f} s")
    print(f"difference {args.gib:g} GiB - 1 MiB: new run {b - s:+.2f} s, restart "
          f"{a - s:+.2f} s (goal: within 1 s)")


if __name__ == "__main__":
    main()
