"""A small job's checkpoint cost, as a user sees it: how long a save blocks training and
how long a resume takes, next to the plain code a user would write instead, measured in
the same run.

The job: the quick start's model (a byte GPT, 3 x 160) with its AdamW state, one
process. Each process measured is a fresh interpreter, because the first save and every
resume are the ones a run pays once per start (lazy imports and first calls included).

- **save**: the trainer's own path (the full format's ``collect``, then the
  Checkpointer: every file hashed and fsync'ed, checksums.json, the folder renamed into
  place, ``latest`` replaced, old checkpoints pruned) against ``torch.save`` of the
  model's and optimizer's ``state_dict()`` into a file, flushed and fsync'ed. One
  process makes every save of a round, alternating the two: the first save of the
  process is reported apart from the median of the later ones.
- **resume**: the trainer's (find the newest checkpoint, verify every file against its
  checksums, ``torch.load(weights_only=True)``, load model and optimizer) against SHA-256
  of the plain file, ``torch.load(weights_only=True)`` and ``load_state_dict`` of model
  and optimizer. Each in its own fresh process, alternating.

    python -m bench.small_checkpoint [--rounds 5] [--saves 10] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _job():
    import torch

    import train.loop.trainer  # noqa: F401  (what a worker has loaded before its first save)
    from train.core.config.schema import ModelConfig
    from train.distributed import compiler_stack
    from train.models import GPT
    torch.manual_seed(0)
    model = GPT(ModelConfig(kind="gpt", depth=3, width=160, heads=5, context_length=128,
                            dropout=0.0), 256)
    # as the trainer's parallelize does without compile: torch's compiler stays unloaded
    compiler_stack.keep_unloaded()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def _train_one_step(model, optimizer) -> None:
    import torch
    model(torch.randint(0, 256, (2, 128))).float().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _ours(model, optimizer, ckpt, step: int) -> None:
    from train.checkpoint import formats
    from train.checkpoint.state import rank_payload
    model_state, optim_state, _ = formats.FORMATS["full"].collect(model, optimizer, False)
    shared = {"step": step, "model": model_state, "optimizer": optim_state, "format": "full"}
    ckpt.save(step, shared, rank_payload(0))


def _plain(model, optimizer, path: Path, step: int) -> None:
    import torch
    with path.open("wb") as f:
        torch.save({"step": step, "model": model.state_dict(),
                    "optimizer": optimizer.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())


def save_worker(run_dir: Path, saves: int, plain_first: bool = False) -> dict:
    """In a fresh process: ``saves`` saves each way, alternating (seconds). Whichever goes
    first pays the process's first touches of torch's serialization for both, so the
    rounds alternate which one that is (``plain_first``)."""
    from train.checkpoint import Checkpointer
    model, optimizer = _job()
    _train_one_step(model, optimizer)
    ckpt = Checkpointer(run_dir, rank=0, keep_last=2)
    ours, plain = [], []

    def timed(record: list, save) -> None:
        start = time.perf_counter()
        save()
        record.append(time.perf_counter() - start)

    for step in range(1, saves + 1):
        pair = [(ours, lambda step=step: _ours(model, optimizer, ckpt, step)),
                (plain, lambda step=step: _plain(model, optimizer, run_dir / "plain.pt", step))]
        for record, save in reversed(pair) if plain_first else pair:
            timed(record, save)
    return {"ours": ours, "plain": plain,
            "bytes": (run_dir / "checkpoints" / f"step-{saves}" / "state.pt").stat().st_size}


def resume_worker(run_dir: Path, which: str) -> dict:
    """In a fresh process: one resume, the trainer's or the plain one (seconds)."""
    import torch
    model, optimizer = _job()
    start = time.perf_counter()
    if which == "ours":
        from train.checkpoint import formats, reader
        from train.checkpoint.state import Restored
        path, shared, _ = reader.newest_loadable(run_dir / "checkpoints")
        saved = Restored(shared)
        formats.of_checkpoint(saved).load(model, optimizer, saved, path)
    else:
        plain = run_dir / "plain.pt"
        hashlib.sha256(plain.read_bytes()).hexdigest()
        state = torch.load(plain, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "exp_avg_sum": float(sum(
        s["exp_avg"].double().sum() for s in optimizer.state.values()))}


def _in_fresh_process(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.small_checkpoint", "--worker", *args],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"bench.small_checkpoint worker {args}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def measure(rounds: int, saves: int, workdir: Path) -> dict:
    first, later, first_plain, later_plain, resumes, plain_resumes = [], [], [], [], [], []
    size = 0
    for _ in range(rounds):
        run_dir = Path(tempfile.mkdtemp(dir=workdir))
        saved = _in_fresh_process("save", str(run_dir), str(saves), str(len(first) % 2))
        size = saved["bytes"]
        first.append(saved["ours"][0])
        first_plain.append(saved["plain"][0])
        later.append(statistics.median(saved["ours"][1:]))
        later_plain.append(statistics.median(saved["plain"][1:]))
        ours = _in_fresh_process("resume", str(run_dir), "ours")
        plain = _in_fresh_process("resume", str(run_dir), "plain")
        if abs(ours["exp_avg_sum"] - plain["exp_avg_sum"]) > 1e-9 * abs(plain["exp_avg_sum"]):
            raise SystemExit("bench.small_checkpoint: the two resumes loaded different "
                             "optimizer states")
        resumes.append(ours["seconds"])
        plain_resumes.append(plain["seconds"])
        subprocess.run(["rm", "-rf", str(run_dir)], check=False)
    med = statistics.median
    return {"MiB": size / MiB, "first": med(first), "first_plain": med(first_plain),
            "later": med(later), "later_plain": med(later_plain),
            "resume": med(resumes), "resume_plain": med(plain_resumes),
            "first_ratio": med(a / b for a, b in zip(first, first_plain, strict=True)),
            "later_ratio": med(a / b for a, b in zip(later, later_plain, strict=True)),
            "resume_ratio": med(a / b for a, b in zip(resumes, plain_resumes, strict=True))}


def report(rounds: int, saves: int, workdir: Path) -> None:
    r = measure(rounds, saves, workdir)
    print(f"small job ({r['MiB']:.1f} MiB, quick start's model + AdamW, 1 process, "
          f"{rounds} rounds, medians):")
    print(f"  first save of a process blocks {r['first']:.3f} s, torch.save + fsync "
          f"{r['first_plain']:.3f} s: ratio {r['first_ratio']:.2f}")
    print(f"  later saves block {r['later']:.3f} s, torch.save + fsync "
          f"{r['later_plain']:.3f} s: ratio {r['later_ratio']:.2f}")
    print(f"  resume {r['resume']:.3f} s, SHA-256 + torch.load + load_state_dict "
          f"{r['resume_plain']:.3f} s: ratio {r['resume_ratio']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary "
                        "folder under $TMPDIR): the disk measured")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        report(args.rounds, args.saves, Path(tmp))


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        kind, run_dir = sys.argv[2], Path(sys.argv[3])
        result = save_worker(run_dir, int(sys.argv[4]), sys.argv[5:] == ["1"]) \
            if kind == "save" else \
            resume_worker(run_dir, sys.argv[4])
        print(json.dumps(result))
    else:
        main()
