"""Replica groups (``distributed.fault_tolerance: replicas``) on a dataset whose samples
cost time to load, with the micro-batches read in the training process
(``data.num_workers=0``) and loaded ahead by loader workers (``data.num_workers=2``,
train/data/prefetch.py): committed steps per second, measured side by side.

The dataset (written into the bench's folder, ``data.kind: custom``) waits ``--ms``
milliseconds per sample, as a decode or a fetch from object storage would, without using
a CPU; the model is the default mlp, a global batch of 16 in 2 groups (8 samples a
group a step). Each run trains ``--steps`` steps; the rate is that of the committed
steps after the first 50 (``RUN_DIR/ledger.jsonl`` polled with a timestamp). With
``--kill``, group 1's worker is killed (kill -9) at step 100 of each run: group 0 takes
both slots until group 1 has restarted and healed, and its loader workers follow (the
rate then includes that time). Both runs' final weights are compared (they are equal:
the workers load the same samples).

    python -m bench.replica_data [--ms 2] [--steps 600] [--kill]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

from bench.replicas import LedgerWatch, load
from tests.harness.procs import replica_workers
from tests.harness.runs import ENTRY, clean_env, write_config

SKIP = 50  # steps of start-up left out of the rate
KILL_AT = 100

SLOW = textwrap.dedent('''
    import time
    import torch

    class Slow(torch.utils.data.Dataset):
        """32 features and a class a sample, each after ``ms`` ms of waiting."""

        def __init__(self, samples, ms):
            self.x = torch.randn(samples, 32, generator=torch.Generator().manual_seed(0))
            self.y = (self.x.sum(1) > 0).long()
            self.ms = ms

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            time.sleep(self.ms / 1000)
            return self.x[i], self.y[i]

    def make(samples=4096, ms=2.0):
        return Slow(samples, ms)
''')


def run(work: Path, workers: int, ms: float, steps: int, kill: bool) -> tuple[float, Path]:
    """One run to its end: (committed steps per second after SKIP, its final state)."""
    name = f"workers-{workers}"
    cfg = write_config(work / f"{name}.yaml", {
        "run": {"name": name}, "output": {"dir": str(work / "runs")},
        "model": {"kind": "mlp"},
        "data": {"kind": "custom", "factory": "slowdata:make", "args": {"ms": ms},
                 "num_classes": 2, "num_workers": workers},
        "train": {"max_steps": steps, "global_batch_size": 16, "eval_batches": 1},
        "logging": {"every_steps": 1000, "progress": "plain"},
        "checkpoint": {"every_steps": steps},
        "distributed": {"fault_tolerance": "replicas", "replicas": 2, "max_restarts": 3}})
    err = (work / f"{name}.err").open("w")
    proc = subprocess.Popen([sys.executable, ENTRY, "train", str(cfg)], cwd=work,
                            env=clean_env(), stdout=subprocess.DEVNULL, stderr=err)
    ledger = LedgerWatch(work / "runs" / name / "ledger.jsonl")
    try:
        ledger.wait(lambda n: n >= SKIP, 600, f"{SKIP} committed steps")
        if kill:
            ledger.wait(lambda n: n >= KILL_AT, 600, f"{KILL_AT} committed steps")
            os.kill(replica_workers(proc.pid)[1], signal.SIGKILL)
            print(f"  {name}: kill -9 of group 1's worker at step {ledger.poll()}", flush=True)
        ledger.wait(lambda n: n >= steps, 1200, f"{steps} committed steps")
        if proc.wait(timeout=300) != 0:
            sys.exit(f"the run with {workers} workers ended with {proc.returncode}: "
                     f"{(work / f'{name}.err').read_text()[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()
    rate = (steps - SKIP) / (ledger.seen[steps - 1] - ledger.seen[SKIP - 1])
    return rate, work / "runs" / name / "checkpoints" / f"step-{steps}" / "state.pt"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=float, default=2.0, help="waiting per sample")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--kill", action="store_true", help=f"kill -9 group 1's worker "
                        f"at step {KILL_AT}")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-replica-data-") as tmp:
        work = Path(tmp)
        (work / "slowdata.py").write_text(SLOW)
        print(f"load at the start {load()}", flush=True)
        rates, states = {}, {}
        for workers in (0, 2):
            rates[workers], states[workers] = run(work, workers, args.ms, args.steps,
                                                  args.kill)
            print(f"  data.num_workers={workers}: {rates[workers]:.1f} committed steps/s "
                  f"(load {load()})", flush=True)
        a, b = (torch.load(states[w], weights_only=True)["model"] for w in (0, 2))
        same = all(torch.equal(a[k], b[k]) for k in a)
    print(f"{args.ms:g} ms a sample, 8 samples a group a step"
          f"{', kill -9 of group 1 at step ' + str(KILL_AT) if args.kill else ''}: "
          f"{rates[2]:.1f} steps/s with 2 loader workers against {rates[0]:.1f} without "
          f"({rates[2] / rates[0]:.2f} x); final weights equal: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
