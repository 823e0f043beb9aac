"""Start-up: command -> first training step, the trainer against torchrun running a plain
hand-written DDP script (bench/plain_ddp.py: the same model, data and batch).

Both start 2 processes (gloo, 127.0.0.1) on the config of bench/ddp_overhead.py, in
alternating rounds. The time is when the first step's line reaches this process (the
trainer's "step 1/", the plain script's "step 1 done"). For the trainer the phases are
split where its output shows them: the launcher's checks up to "entrypoint: run", the
workers' start (torchrun, imports, rendezvous, data, model) up to "model ...", then the
first step. Prints medians and the ratio trainer/plain (target: at most 1.2).

    python -m bench.startup [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.ddp_overhead import ROOT, bench_config

MARKS = {"launcher checks": r"^entrypoint: run ", "workers start": r"INFO model ",
         "first step": r"step 1/"}


def timed(cmd: list[str], marks: dict[str, str], env: dict) -> dict[str, float]:
    """Seconds from start to the first line matching each mark (the last mark ends it)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen: dict[str, float] = {}
    last = list(marks)[-1]
    for line in proc.stdout:
        for name, pattern in marks.items():
            if name not in seen and re.search(pattern, line):
                seen[name] = time.monotonic() - start
        if last in seen:
            break
    proc.kill()
    proc.wait()
    proc.stdout.close()
    if last not in seen:
        sys.exit(f"no {marks[last]!r} from {' '.join(cmd)}")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    plain, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        config = bench_config(Path(tmp), 5)
        for round_ in range(args.rounds):
            plain.append(timed([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node=2", str(ROOT / "bench" / "plain_ddp.py"),
                                str(config), "0"], {"first step": r"plain: step 1 done"},
                               env)["first step"])
            ours.append(timed([sys.executable, str(ROOT / "entrypoint.py"), "train",
                               str(config), f"run.name=start-{round_}",
                               "distributed.nproc_per_node=2", "logging.every_steps=1"],
                              MARKS, env))
    reference = statistics.median(plain)
    print(f"command -> first step, 2 processes, medians of {args.rounds} rounds:")
    print(f"  torchrun + plain DDP script   {reference:6.2f} s")
    total = statistics.median(r["first step"] for r in ours)
    print(f"  trainer (entrypoint.py train) {total:6.2f} s")
    before = 0.0
    for name in MARKS:
        at = statistics.median(r[name] for r in ours)
        print(f"    {name:28s}{at - before:6.2f} s")
        before = at
    print(f"  ratio trainer/plain           {total / reference:6.2f} (target <= 1.2)")


if __name__ == "__main__":
    main()
