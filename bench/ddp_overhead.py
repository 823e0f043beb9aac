"""DDP overhead of the trainer against a plain hand-written DDP loop.

Both run the same model, data and global batch on 2 processes (torchrun, gloo,
127.0.0.1), in alternating rounds so that machine noise hits both alike. Two figures:

- wall time per step: the trainer's from its own metrics.jsonl (intervals after the
  warm-up steps), the plain loop's timed around the same steps;
- CPU time per step: user + system of every process (torchrun, both workers), from a
  short and a long run of each, (long - short) / (the steps between), so that start-up
  cancels out. On a loaded machine this is the stable figure (wall time swings with
  the other jobs; the CPU a step takes does not).

Then a profile of the trainer (cProfile in each of the 2 processes, rank 0's read):
the time per step of each piece of its machinery around forward, backward and the
optimizer (data loading, logging, the stop agreement, the watchdog, the gradient norm
for clipping and the divergence guard...), as a share of the step, and all of it
together against the goal of 0.5 %. The profile counts CPU time, not wall time, so the
time a rank waits in a collective for its slower peer is not charged to that collective
(a plain loop waits the same at its next gradient all-reduce). cProfile slows Python
code more than torch's kernels, so the shares are upper bounds.

    python -m bench.ddp_overhead [--rounds 3] [--steps 160] [--short 20]

``--rounds 0`` runs the profile alone (CPU time: usable on a busy machine).
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from bench.measure import measured

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


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def torchrun(*args: str) -> tuple[str, float]:
    """(stdout, CPU seconds of the whole tree)."""
    run = measured([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", *args], env(), ROOT, timeout=900)
    return run.stdout, run.cpu_s


def plain(config: Path, warmup: int, steps: int) -> tuple[float, float]:
    """(wall s per timed step, CPU s of the run)."""
    out, cpu = torchrun(str(ROOT / "bench" / "plain_ddp.py"), str(config), str(warmup),
                        f"train.max_steps={steps}")
    return json.loads(out.strip().splitlines()[-1])["step_time_s"], cpu


def trainer(config: Path, warmup: int, steps: int, name: str) -> tuple[float, float]:
    _, cpu = torchrun("-m", "train", str(config), f"run.name={name}",
                      f"train.max_steps={steps}")
    rows = [json.loads(line) for line in (config.parent / name / "metrics.jsonl").open()]
    timed = [r for r in rows if "step_time_s" in r and r["step"] > warmup]
    # Each row's step_time_s is the mean over its logging interval (10 steps).
    return statistics.fmean(r["step_time_s"] for r in timed), cpu


# The trainer's machinery around forward/backward/optimizer: (label, file, function).
MACHINERY = (
    ("data (DataLoader, sampler, the batch)", "torch/utils/data/dataloader.py", "__next__"),
    ("hang watchdog (pet, pause)", "train/guards/watchdog.py", ("pet", "pause")),
    ("metrics (jsonl, TensorBoard)", "train/observe/metrics.py", ("step", "log")),
    ("loss, step time and phase times over ranks", "train/distributed/ranks.py",
     "gather_over_ranks"),
    (STRAGGLERS := "straggler phases (and their backward hook)",
     "train/observe/stragglers.py",
     ("next_batch", "forward", "backward", "update", "take", "observe", "started",
      "gradients_done")),
    ("stop agreement", "train/guards/stopping.py", ("agreed", "pace")),
    ("gradient norm (clipping, divergence guard)", "train/models/optim.py", "grad_norm_and_clip"),
    ("divergence guard", "train/guards/divergence.py", ("gradients", "loss")),
    ("checkpoint cadence", "train/checkpoint/policy.py", "due"),
    ("sample counter", "train/checkpoint/state.py", "advance"),
)
# (StepPhases call, the callee's file and function): the work each of those calls runs
# and times, counted elsewhere (the data) or not machinery at all.
TIMED_WORK = (("next_batch", "torch/utils/data/dataloader.py", "__next__"),
              ("forward", "train/models/losses.py", "__call__"),
              ("backward", "torch/_tensor.py", "backward"),
              ("update", "train/loop/steps.py", "optimizer_step"))
# The plain loop clips too (clip_grad_norm_): the trainer's machinery beyond it is the rest.
IN_THE_PLAIN_LOOP = ("data (DataLoader, sampler, the batch)",
                     "gradient norm (clipping, divergence guard)")
MACHINERY_GOAL = 0.005

# A worker under cProfile: its main() in this process, the profile written before the
# exit (the worker's own exit skips the interpreter's finalisation, so cProfile's would not).
# The clock is the main thread's CPU time: a rank waiting in a collective for a slower
# peer (which a plain loop waits out at its next gradient all-reduce instead) costs
# nothing, and the CPU that gloo's threads spend on DDP's bucket all-reduces while the
# main thread runs some small function is not charged to that function (with the
# process's CPU time it was: the callback ending the backward pass read 0.1 ms a call).
# Python calls only (builtins=False): each C function called (a clock read, a dict's get)
# was a profiled event of its own, and an event costs the profiler a microsecond or more
# of that clock, far more than those calls themselves; their time is their caller's.
# With them the same machinery read 0.52-0.54 % where it reads 0.45 % without (12-04).
PROFILED = """import cProfile, os, sys, time
import train.__main__ as worker
profile = cProfile.Profile(time.thread_time, builtins=False)
code = profile.runcall(worker.main, sys.argv[2:])
profile.dump_stats(sys.argv[1].format(rank=os.environ.get("RANK", "0")))
sys.stdout.flush()
os._exit(code)
"""


def profile(config: Path, steps: int) -> list[tuple[str, float]]:
    """(label, seconds per step) of each piece of MACHINERY, then the loop's own code and
    the whole step, from rank 0 of a 2-process run under cProfile. The step excludes
    the checkpoint at the end (not a per-step cost)."""
    out = config.parent / "trainer-{rank}.prof"
    measured([sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node=2", "--no-python", sys.executable, "-c", PROFILED, str(out),
              str(config), "run.name=profiled", f"train.max_steps={steps}"], env(), ROOT,
             timeout=900)
    stats = pstats.Stats(str(out).format(rank=0)).stats  # (file, line, fn) -> (cc, nc, tt, ct, _)

    def cumulative(file: str, functions) -> float:
        names = (functions,) if isinstance(functions, str) else functions
        return sum(v[3] for (f, _, fn), v in stats.items() if f.endswith(file) and fn in names)

    def called_from(file: str, function: str, callee_file: str, callee: str) -> float:
        """Cumulative seconds of ``callee`` in the calls ``function`` made to it."""
        return sum(edge[3] for (f, _, fn), v in stats.items()
                   if f.endswith(callee_file) and fn == callee
                   for (cf, _, cfn), edge in v[4].items()
                   if cf.endswith(file) and cfn == function)

    rows = [(label, cumulative(file, fns) / steps) for label, file, fns in MACHINERY]
    # StepPhases' calls run the work they time: that work is not machinery
    timed_work = sum(called_from("train/observe/stragglers.py", *edge) for edge in TIMED_WORK)
    rows = [(label, seconds - timed_work / steps if label == STRAGGLERS else seconds)
            for label, seconds in rows]
    loop_own = sum(v[2] for (f, _, fn), v in stats.items()
                   if f.endswith("train/loop/trainer.py") and fn in ("train_steps", "train_step",
                                                                  "optimizer_step"))
    rows.append(("the loop's own lines", loop_own / steps))
    whole = cumulative("train/loop/trainer.py", "train_steps") - \
        cumulative("train/checkpoint/session.py", "save_checkpoint")
    rows.append(("whole step (train_steps)", whole / steps))
    return rows


def print_profile(rows: list[tuple[str, float]]) -> None:
    whole = rows[-1][1]
    print("the trainer's step, rank 0 of 2 processes under cProfile, CPU time (upper bounds):")
    for label, seconds in rows:
        print(f"  {label:<44}{seconds * 1000:>8.2f} ms {seconds / whole:>7.2%}")
    beyond = sum(s for label, s in rows[:len(MACHINERY)] if label not in IN_THE_PLAIN_LOOP)
    print(f"  machinery a plain loop does not have: {beyond / whole:.2%} of the step "
          f"(goal < {MACHINERY_GOAL:.1%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="0: the profile alone")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--short", type=int, default=20, help="steps of the short runs")
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    walls, cpus = {"plain": [], "trainer": []}, {"plain": [], "trainer": []}
    span = args.steps - args.short
    with tempfile.TemporaryDirectory() as tmp:
        config = bench_config(Path(tmp), args.steps)
        for r in range(args.rounds):
            runs = {"plain": lambda: (plain(config, args.warmup, args.steps),
                                      plain(config, 0, args.short)),
                    "trainer": lambda r=r: (trainer(config, args.warmup, args.steps, f"long-{r}"),
                                            trainer(config, 0, args.short, f"short-{r}"))}
            order = ("plain", "trainer") if r % 2 == 0 else ("trainer", "plain")  # no order bias
            done = {name: runs[name]() for name in order}
            (p_wall, p_long), (_, p_short) = done["plain"]
            (t_wall, t_long), (_, t_short) = done["trainer"]
            walls["plain"].append(p_wall)
            walls["trainer"].append(t_wall)
            cpus["plain"].append((p_long - p_short) / span)
            cpus["trainer"].append((t_long - t_short) / span)
            print(f"round {r + 1}: wall plain {p_wall * 1000:.1f} ms/step, trainer "
                  f"{t_wall * 1000:.1f}; CPU plain {cpus['plain'][-1] * 1000:.1f} ms/step, "
                  f"trainer {cpus['trainer'][-1] * 1000:.1f}", flush=True)
        rows = profile(config, args.steps)
    for kind, values in (("wall", walls), ("CPU", cpus)) if args.rounds else ():
        p, t = statistics.median(values["plain"]), statistics.median(values["trainer"])
        print(f"median {kind} time per step: plain {p * 1000:.1f} ms, trainer {t * 1000:.1f} "
              f"ms; ratio trainer/plain {t / p:.3f}")
    print_profile(rows)


if __name__ == "__main__":
    main()
