"""The speed defaults, each against a plain hand-written loop, end to end, in one run.

Two shapes: the quick start (configs/quickstart.yaml, one process on every thread) and
the 2-process DDP bench (bench/ddp_overhead.py's model, 2 processes x 1 thread, gloo).
For each, in rounds that alternate the order (machine noise hits every variant alike):

- plain: bench/plain_ddp.py with torch's defaults (per-tensor AdamW, eager, fp32), the
  loop a user writes by hand;
- plain with one choice changed: the fused AdamW kernel, ``torch.compile`` (a cold
  compile cache, as on a user's first run), bf16 autocast (fewer steps: it is slow on
  CPUs without bf16 matmul units, and only its time per step is compared);
- the trainer (``entrypoint.py train``) with its defaults.

Per variant (medians over the rounds): the time per step after the warm-up (the plain
loop's mean over its steps, the trainer's median over its 10-step logging intervals,
which are means themselves), the whole command's wall time (start-up, compile,
checkpoints and exit included) and CPU time (user + system of every process), each as a
ratio to plain; the fixed cost (wall - steps x step time), and the end-to-end ratio
projected to the quick start's ``train.max_steps`` (fixed + 500 x step), which says
whether a one-off cost such as compiling is paid back over a real run.
Then the same plain variants (not bf16) in one process, in alternating blocks of steps:
separate processes on a shared machine swing by 10 % or more between rounds, blocks in
one process far less, so small per-step differences (an optimizer kernel) show there.
Last, a profile of the plain step: the share of its CPU time in matmul and attention
kernels, which no loop-level choice changes in fp32 (the ceiling on what defaults win).
These two build their models on the CPU, so they run only where the rounds did (no GPU).

    python -m bench.defaults [--rounds 2] [--steps 60] [--warmup 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.ddp_overhead import bench_config
from bench.measure import measured
from train.core.config import load_config

ROOT = Path(__file__).resolve().parent.parent

HAND_WRITTEN = ("optim.fused=false", "compile=false", "precision=fp32")
VARIANTS = {  # label -> (runner, overrides on top of HAND_WRITTEN)
    "plain (torch defaults)": ("plain", ()),
    "plain + fused AdamW": ("plain", ("optim.fused=true",)),
    "plain + torch.compile": ("plain", ("compile=true",)),
    "plain + bf16 autocast": ("plain", ("precision=bf16",)),
    "trainer (its defaults)": ("trainer", None),  # None: the config as it is
}
SLOW = {"plain + bf16 autocast"}  # runs steps // SLOW_DIVISOR steps, per step only
SLOW_DIVISOR = 5


@dataclass(frozen=True)
class Shape:
    name: str
    nproc: int
    threads: int
    config: Path
    overrides: tuple[str, ...]


@dataclass
class Result:
    step_s: list[float]
    wall_s: list[float]
    cpu_s: list[float]
    steps: int


def shapes(workdir: Path, cpus: int) -> list[Shape]:
    two = workdir / "two"
    two.mkdir()
    return [Shape("quick start: 1 process", 1, cpus, ROOT / "configs" / "quickstart.yaml",
                  (f"output.dir={workdir / 'one'}", "logging.progress=plain")),
            Shape("2-process DDP", 2, 1, bench_config(two, 160), ())]


def run_variant(shape: Shape, label: str, steps: int, warmup: int, tag: str,
                workdir: Path) -> tuple[float, float, float]:
    """(s per step after the warm-up, wall s of the command, CPU s of its tree)."""
    runner, changes = VARIANTS[label]
    cache = tempfile.mkdtemp(dir=workdir)  # a cold compile cache for every run
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(shape.threads),
               TORCHINDUCTOR_CACHE_DIR=cache)
    overrides = [*shape.overrides, f"train.max_steps={steps}"]
    start = time.monotonic()
    if runner == "plain":
        run = measured([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={shape.nproc}", str(ROOT / "bench/plain_ddp.py"),
                        str(shape.config), str(warmup), *overrides, *HAND_WRITTEN, *changes],
                       env, ROOT)
        step = json.loads(run.stdout.strip().splitlines()[-1])["step_time_s"]
    else:
        run = measured([sys.executable, str(ROOT / "entrypoint.py"), "train",
                        str(shape.config), *overrides, f"run.name={tag}",
                        f"distributed.nproc_per_node={shape.nproc}"], env, ROOT)
        out = load_config(shape.config, list(overrides)).output.dir
        rows = [json.loads(line) for line in (Path(out) / tag / "metrics.jsonl").open()]
        # Each row's step_time_s is the mean over its logging interval.
        step = statistics.median(r["step_time_s"] for r in rows
                                 if "step_time_s" in r and r["step"] > warmup)
    return step, time.monotonic() - start, run.cpu_s


def measure_shape(shape: Shape, rounds: int, steps: int, warmup: int,
                  workdir: Path) -> dict[str, Result]:
    results = {label: Result([], [], [], steps // SLOW_DIVISOR if label in SLOW else steps)
               for label in VARIANTS}
    for r in range(rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for label in order:
            res = results[label]
            step, wall, cpu = run_variant(shape, label, res.steps,
                                          warmup if label not in SLOW else 2,
                                          f"r{r}-{len(res.wall_s)}-{label[:4]}", workdir)
            res.step_s.append(step)
            res.wall_s.append(wall)
            res.cpu_s.append(cpu)
            print(f"  round {r + 1}: {label:<24} {step * 1000:7.1f} ms/step, "
                  f"{wall:6.1f} s wall, {cpu:6.1f} s CPU", flush=True)
    return results


def report(shape: Shape, results: dict[str, Result], real_steps: int) -> None:
    med = {label: {k: statistics.median(getattr(res, k)) for k in ("step_s", "wall_s", "cpu_s")}
           for label, res in results.items()}
    base, base_steps = med["plain (torch defaults)"], results["plain (torch defaults)"].steps

    def projected(m: dict, steps: int) -> float:
        return m["wall_s"] - steps * m["step_s"] + real_steps * m["step_s"]

    print(f"{shape.name} ({shape.nproc} x {shape.threads} thread(s)), ratios to plain; "
          f"projected = fixed cost + {real_steps} steps (train.max_steps):")
    print(f"  {'variant':<24}{'ms/step':>9}{'ratio':>7}{'fixed s':>9}{'wall s':>8}"
          f"{'ratio':>7}{'CPU s':>8}{'ratio':>7}{'projected':>11}")
    for label, m in med.items():
        steps = results[label].steps
        row = (f"  {label:<24}{m['step_s'] * 1000:>9.1f}{m['step_s'] / base['step_s']:>7.3f}"
               f"{m['wall_s'] - steps * m['step_s']:>9.1f}")
        if steps != base_steps:  # a shorter run: only its step compares
            print(row + f"{'(per step only: ' + str(steps) + ' steps)':>41}")
            continue
        print(row + f"{m['wall_s']:>8.1f}{m['wall_s'] / base['wall_s']:>7.3f}{m['cpu_s']:>8.1f}"
              f"{m['cpu_s'] / base['cpu_s']:>7.3f}"
              f"{projected(m, steps) / projected(base, base_steps):>11.3f}")


@contextlib.contextmanager
def quiet_stderr():
    """The profiler's C++ side writes a line to fd 2 at start and stop."""
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def plain_step(config: Path, overrides: list[str], batch: int):
    """One plain training step of ``config`` (model, optimizer, data built once) as a
    function of the step's index; ``compile=true`` compiles the model."""
    import torch
    import torch.nn.functional as F

    from train.data.builders import build_data
    from train.models import build_model
    from train.models.optim import build_optimizer
    cfg = load_config(config, overrides)
    torch.manual_seed(cfg.seed)
    data = build_data(cfg)
    model = build_model(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    opt = build_optimizer(model, cfg.optim)
    forward = torch.compile(model) if cfg.compile else model

    def step(i: int) -> None:
        first = i * batch % (len(data.train) - batch)
        x, y = data.train.__getitems__(list(range(first, first + batch)))
        F.cross_entropy(forward(x).flatten(0, -2), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


IN_PROCESS = {"plain (torch defaults)": (), "plain + fused AdamW": ("optim.fused=true",),
              "plain + torch.compile": ("compile=true",),
              "plain + fused + compile": ("optim.fused=true", "compile=true")}


def interleaved(config: Path, threads: int, batch: int, blocks: int = 12,
                per_block: int = 10) -> dict[str, float]:
    """Median s per step of each IN_PROCESS variant, run in one process in alternating
    blocks of steps (after one block of warm-up each: compile time left out): far less
    noise than separate processes, so small differences show."""
    import torch
    torch.set_num_threads(threads)
    steps = {label: plain_step(config, [*HAND_WRITTEN, *changes], batch)
             for label, changes in IN_PROCESS.items()}
    times: dict[str, list[float]] = {label: [] for label in steps}
    i = 0
    for block in range(blocks + 1):
        order = list(steps) if block % 2 == 0 else list(reversed(steps))
        for label in order:
            start = time.perf_counter()
            for _ in range(per_block):
                steps[label](i)
                i += 1
            if block:  # block 0 is the warm-up (and the compile)
                times[label].append((time.perf_counter() - start) / per_block)
    return {label: statistics.median(t) for label, t in times.items()}


def kernel_shares(config: Path, threads: int, steps: int = 8) -> tuple[float, float, float]:
    """(ms per step, matmul share, attention share) of the plain eager fp32 step."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.set_num_threads(threads)
    cfg = load_config(config, [])
    step = plain_step(config, list(HAND_WRITTEN), cfg.train.global_batch_size)
    for i in range(3):
        step(i)
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            step(i + 3)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events
                 if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"))
    attention = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key)
    return total / steps / 1000, matmul / total, attention / total


def in_process_report(shape: Shape) -> None:
    cfg = load_config(shape.config, list(shape.overrides))
    batch = cfg.train.global_batch_size // shape.nproc  # one rank's share
    med = interleaved(shape.config, shape.threads, batch)
    base = med["plain (torch defaults)"]
    print(f"  in one process, alternating blocks of 10 steps ({shape.threads} thread(s), "
          f"batch {batch}; {'one rank, no all-reduce; ' if shape.nproc > 1 else ''}"
          f"compile time left out):")
    for label, seconds in med.items():
        print(f"  {label:<24}{seconds * 1000:>9.1f}{seconds / base:>7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    cpus = max(1, len(os.sched_getaffinity(0)))
    project = load_config(ROOT / "configs" / "quickstart.yaml", []).train.max_steps
    import torch
    on_cpu = not torch.cuda.is_available()  # the runs' configs choose the GPU where there is one
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes(Path(tmp), cpus):
            print(f"{shape.name}:", flush=True)
            results = measure_shape(shape, args.rounds, args.steps, args.warmup, Path(tmp))
            report(shape, results, project)
            if on_cpu:
                in_process_report(shape)
    if not on_cpu:
        print("the in-process blocks and the kernel profile measure the CPU: skipped where "
              "the runs above used a GPU")
        return
    ms, matmul, attention = kernel_shares(ROOT / "configs" / "quickstart.yaml", cpus)
    print(f"the quick start's plain step under torch.profiler: {ms:.0f} ms of CPU, "
          f"{matmul:.0%} in matmul kernels, {attention:.0%} in attention: fp32 kernels that "
          f"no loop-level default changes")


if __name__ == "__main__":
    main()
