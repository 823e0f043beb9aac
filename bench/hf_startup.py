"""Start-up of a heavy factory: the GPT-2 of docs/your-code.md (transformers, random
init, 2 processes, gloo), from the command to its first training step, and the time of
``train --dry-run``, against one plain import of the factory's module (what every
process that imports it pays, measured in the same run).

A factory module that imports transformers costs seconds to import; the launcher reads
the user's code without importing it (train/core/user/usersource.py), so only the workers
pay. The reference is the same dry run with the built-in gpt in place of the factory.
The phases are those of bench/startup.py: the launcher's checks up to "entrypoint:
run", the workers' start up to "INFO model", then the first step. Needs transformers
(``make hf``). Prints medians of alternating rounds and the load average.

    python -m bench.hf_startup [--rounds 3]
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

from bench.ddp_overhead import ROOT
from bench.startup import MARKS

FACTORY = '''
from transformers import GPT2Config, GPT2LMHeadModel


def gpt2():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=256,
                                      n_positions=128, bos_token_id=None, eos_token_id=None,
                                      use_cache=False))
'''
CONFIG = """
model: {kind: custom, factory: hf_gpt2:gpt2, context_length: 32}
data: {kind: text, max_bytes: 60000, num_workers: 0}
train: {max_steps: 1, global_batch_size: 8, eval_batches: 0}
logging: {every_steps: 1, progress: plain}
distributed: {nproc_per_node: 2}
"""


def seconds(cmd: list[str], cwd: Path, env: dict) -> float:
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return time.monotonic() - start


def to_step_1(cmd: list[str], cwd: Path, env: dict) -> dict[str, float]:
    """Seconds from the command to the first line matching each of MARKS; the run (one
    step) is left to finish, so that no worker is still writing during the next round."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen: dict[str, float] = {}
    for line in proc.stdout:
        for name, pattern in MARKS.items():
            if name not in seen and re.search(pattern, line):
                seen[name] = time.monotonic() - start
    if proc.wait() != 0 or len(seen) < len(MARKS):
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}, marks seen {sorted(seen)}")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    entry = [sys.executable, str(ROOT / "entrypoint.py")]
    rows: dict[str, list[float]] = {"import hf_gpt2 (plain python)": [],
                                    "train --dry-run, built-in gpt": [], "train --dry-run": []}
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        (project / "hf_gpt2.py").write_text(FACTORY)
        (project / "gpt2.yaml").write_text(CONFIG)
        (project / "builtin.yaml").write_text(CONFIG.replace("custom, factory: hf_gpt2:gpt2",
                                                             "gpt"))
        for r in range(args.rounds):
            rows["import hf_gpt2 (plain python)"].append(
                seconds([sys.executable, "-c", "import hf_gpt2"], project, env))
            rows["train --dry-run, built-in gpt"].append(
                seconds([*entry, "train", "builtin.yaml", "--dry-run"], project, env))
            rows["train --dry-run"].append(
                seconds([*entry, "train", "gpt2.yaml", "--dry-run"], project, env))
            run = to_step_1([*entry, "train", "gpt2.yaml", f"run.name=r{r}"], project, env)
            for name, at in run.items():
                rows.setdefault(f"train: {name}", []).append(at)
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, "
          f"{args.rounds} rounds, medians:")
    base = statistics.median(rows["import hf_gpt2 (plain python)"])
    for name, values in rows.items():
        m = statistics.median(values)
        print(f"  {name:32s} {m:6.1f} s  ({m / base:.2f} x the import)")


if __name__ == "__main__":
    main()
