"""DDP overhead of the trainer against a plain hand-written DDP loop.

Both run the same model, data and global batch on 2 processes (torchrun, gloo,
127.0.0.1), in alternating rounds so that machine noise hits both alike. The trainer's
step time comes from its own metrics.jsonl (intervals after the warm-up steps); the
plain loop times the same steps. Prints the median step times and the ratio
trainer/plain (target: at most 1.03).

    python bench/ddp_overhead.py [--rounds 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"kind": "gpt", "depth": 2, "width": 128, "heads": 4, "context_length": 64}


def bench_config(workdir: Path, steps: int) -> Path:
    tree = {"seed": 0, "model": MODEL, "data": {"kind": "text", "max_bytes": 1_000_000,
                                                "num_workers": 0},
            "optim": {"lr": 1e-3}, "schedule": {"name": "constant"},
            "train": {"max_steps": steps, "global_batch_size": 32, "eval_batches": 0},
            "checkpoint": {"resume_from": "none"},
            "logging": {"every_steps": 10, "progress": "plain", "tensorboard": True},
            "output": {"dir": str(workdir)}}
    path = workdir / "bench.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def torchrun(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"benchmark run failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def plain_step_time(config: Path, warmup: int) -> float:
    out = torchrun(str(ROOT / "bench" / "plain_ddp.py"), str(config), str(warmup))
    return json.loads(out.strip().splitlines()[-1])["step_time_s"]


def trainer_step_time(config: Path, warmup: int, round_: int) -> float:
    name = f"trainer-{round_}"
    torchrun("-m", "train", str(config), f"run.name={name}")
    rows = [json.loads(line) for line in (config.parent / name / "metrics.jsonl").open()]
    timed = [r for r in rows if "step_time_s" in r and r["step"] > warmup]
    # Each row's step_time_s is the mean over its logging interval (10 steps).
    return statistics.fmean(r["step_time_s"] for r in timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    plain, trainer = [], []
    with tempfile.TemporaryDirectory() as tmp:
        config = bench_config(Path(tmp), args.steps)
        for r in range(args.rounds):
            plain.append(plain_step_time(config, args.warmup))
            trainer.append(trainer_step_time(config, args.warmup, r))
            print(f"round {r + 1}: plain {plain[-1] * 1000:.1f} ms/step, "
                  f"trainer {trainer[-1] * 1000:.1f} ms/step", flush=True)
    p, t = statistics.median(plain), statistics.median(trainer)
    print(f"median step time: plain {p * 1000:.1f} ms, trainer {t * 1000:.1f} ms")
    print(f"ratio trainer/plain: {t / p:.3f} (target <= 1.03)")


if __name__ == "__main__":
    main()
