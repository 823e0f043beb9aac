"""What the straggler timing costs a step: the trainer with it on against the same run off.

With ``logging.straggler_ratio`` above 0 (the default, 1.3), every rank times the parts
of its step that do not wait for the others (train/observe/stragglers.py): a clock read
around the batch fetch, the forward pass and the optimizer, and a hook on every
parameter that notes when its gradient was made; its figures ride in the all-gather the
logging step already makes, and rank 0 judges them. ``0`` turns the hooks and the judging
off. Two measurements:

1. **the trainer**, 2 processes (torchrun, gloo, 127.0.0.1), the same config with the
   timing on and off, in alternating rounds so that machine noise hits both alike. CPU
   time per step (user + system of the whole process tree, from a long and a short run
   of each: (long - short) / the steps between, so start-up cancels out; the figure that
   holds on a loaded machine) and wall time per step (the trainer's own metrics.jsonl,
   after the warm-up steps);
2. **the timing alone**, in one process: steps of a tiny model with the bench model's
   parameter tensors (the same hooks, little compute around them) with the real
   :class:`~train.observe.stragglers.StepPhases` and without, interleaved block by
   block: its CPU microseconds per step, and what they are of the trainer's step.

Also printed: what rank 0's slow-link watch (:mod:`train.observe.slowlinks`) costs per
logging step, in one process. The last line is the trainer's ratio, on / off.

    python -m bench.stragglers [--rounds 3] [--steps 160] [--short 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.measure import measured

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"kind": "gpt", "depth": 2, "width": 128, "heads": 4, "context_length": 64}


def bench_config(workdir: Path) -> Path:
    tree = {"seed": 0, "model": MODEL, "data": {"kind": "text", "max_bytes": 1_000_000,
                                                "num_workers": 0},
            "optim": {"lr": 1e-3}, "schedule": {"name": "constant"},
            "train": {"global_batch_size": 32, "eval_batches": 0},
            "checkpoint": {"resume_from": "none"},
            "logging": {"every_steps": 10, "progress": "plain", "tensorboard": False},
            "output": {"dir": str(workdir)}}
    path = workdir / "bench.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def trainer(config: Path, steps: int, warmup: int, name: str, ratio: float
            ) -> tuple[float, float]:
    """(wall s per step after the warm-up, CPU s of the whole run)."""
    run = measured([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", "-m", "train", str(config), f"run.name={name}",
                    f"train.max_steps={steps}", f"logging.straggler_ratio={ratio}"],
                   dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), ROOT,
                   timeout=900)
    rows = [json.loads(line) for line in (config.parent / name / "metrics.jsonl").open()]
    timed = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > warmup]
    return (statistics.fmean(timed) if timed else float("nan")), run.cpu_s


def trainer_rounds(args) -> dict[str, dict[str, list[float]]]:
    """Per setting ("on", "off"): wall and CPU seconds per step of each round."""
    out = {s: {"wall": [], "cpu": []} for s in ("on", "off")}
    ratios = {"on": 1.3, "off": 0}
    with tempfile.TemporaryDirectory() as tmp:
        config = bench_config(Path(tmp))
        for r in range(args.rounds):
            for setting in ("on", "off") if r % 2 == 0 else ("off", "on"):  # no order bias
                wall, long_cpu = trainer(config, args.steps, args.warmup, f"{setting}-l{r}",
                                         ratios[setting])
                _, short_cpu = trainer(config, args.short, 0, f"{setting}-s{r}",
                                       ratios[setting])
                out[setting]["wall"].append(wall)
                out[setting]["cpu"].append((long_cpu - short_cpu) / (args.steps - args.short))
            print(f"round {r + 1}: CPU per step on {out['on']['cpu'][-1] * 1000:.1f} ms, off "
                  f"{out['off']['cpu'][-1] * 1000:.1f} ms; wall per step on "
                  f"{out['on']['wall'][-1] * 1000:.1f} ms, off "
                  f"{out['off']['wall'][-1] * 1000:.1f} ms", flush=True)
    return out


def timing_alone(blocks: int = 40, steps: int = 50) -> tuple[float, float]:
    """(CPU seconds per step without, with the timing): two copies of a tiny model of
    the bench model's shape (little compute around the timing), one watched by
    StepPhases, stepped in alternating blocks; the process's CPU time (steady under
    load)."""
    import torch

    from train.core.config import load_config
    from train.models import build_model
    from train.observe.stragglers import StepPhases
    torch.set_num_threads(1)
    tiny = {**MODEL, "width": 16, "heads": 2, "context_length": 8}
    cfg = load_config(ROOT / "configs/quickstart.yaml", [f"model.{k}={v}"
                                                          for k, v in tiny.items()])
    x = torch.randint(0, 256, (2, tiny["context_length"]))
    models = [build_model(cfg.model, input_shape=(tiny["context_length"],), num_classes=256)
              for _ in range(2)]
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    phases = StepPhases(torch.device("cpu"))
    phases.watch(models[1])
    per_step: list[list[float]] = [[], []]
    for b in range(2 * blocks):
        which = b % 2
        start = time.process_time()
        for _ in range(steps):
            _step(models[which], optims[which], x, phases if which else None)
        if which:
            phases.take()
        per_step[which].append((time.process_time() - start) / steps)
    return statistics.median(per_step[0]), statistics.median(per_step[1])


def _step(model, optim, x, phases) -> None:
    """One training step as the trainer's loop times it (phases None: untimed)."""
    timed = phases or _Untimed()
    batch = timed.next_batch(iter([x]))
    loss = timed.forward(lambda b: model(b).float().logsumexp(-1).mean(), batch)
    timed.backward(loss)
    timed.update(_update, optim)


def _update(optim) -> None:
    optim.step()
    optim.zero_grad(set_to_none=True)


def link_watch_alone(world: int = 64, calls: int = 2000) -> float:
    """CPU seconds rank 0's slow-link watch takes per logging step (train/observe/
    slowlinks.py): ``world`` ranks' figures, 50 ms steps logged every step, so that its
    window holds some 200 intervals (10 s), the most it keeps at that pace."""
    from train.observe.slowlinks import CommWait
    watch = CommWait(ratio=1.3, steps=30)
    rows = [(0.05, 0.005, 0.03)] * world
    start = time.process_time()
    for _ in range(calls):
        watch.observe(1, rows, 0.05)
    return (time.process_time() - start) / calls


class _Untimed:
    """StepPhases' shape with nothing inside: the loop's code without the timing."""

    def next_batch(self, batches):
        return next(batches)

    def forward(self, fn, *args):
        return fn(*args)

    update = forward

    def backward(self, loss) -> None:
        loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--short", type=int, default=20, help="steps of the short runs")
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    plain_s, timed_s = timing_alone()
    print("the timing alone (one process, a tiny model, one backward hook a step): "
          f"{(timed_s - plain_s) * 1e6:+.0f} us CPU a step ({plain_s * 1e6:.0f} us without, "
          f"{timed_s * 1e6:.0f} us with)", flush=True)
    print(f"the slow-link watch alone (rank 0, 64 ranks' figures, a window of 200 "
          f"intervals): {link_watch_alone() * 1e6:.0f} us CPU a logging step; no collective "
          f"is added, the figures ride in the logging step's all-gather", flush=True)
    rounds = trainer_rounds(args)
    on_wall, off_wall = (statistics.median(rounds[s]["wall"]) for s in ("on", "off"))
    print(f"median wall time per step: on {on_wall * 1000:.1f} ms, off "
          f"{off_wall * 1000:.1f} ms; ratio on/off {on_wall / off_wall:.3f}")
    on_cpu, off_cpu = (statistics.median(rounds[s]["cpu"]) for s in ("on", "off"))
    print(f"median CPU time per step (2 ranks): on {on_cpu * 1000:.1f} ms, off "
          f"{off_cpu * 1000:.1f} ms, {(on_cpu - off_cpu) * 1000:+.2f} ms; the timing "
          f"alone would be {2 * (timed_s - plain_s) / off_cpu:.2%} of it; "
          f"ratio on/off {on_cpu / off_cpu:.3f}")


if __name__ == "__main__":
    main()
