"""Oversubscription: the quick start's shape (one process, OpenMP threads = the CPUs)
alone on the machine and next to busy processes (``while True: pass``), per OpenMP
setting. The figure is a setting's step time beside the busy processes over its step
time alone, from one run. A fair share of the CPUs makes it (threads + busy) / CPUs when
the threads fill the CPUs: 2.5 for 2 threads beside 3 busy processes on 2 CPUs.

Each run is the real command, `entrypoint.py train configs/quickstart.yaml`, with the
setting's variables in its environment (a user's OMP_* wins over the launcher's
defaults, so this is also how a user chooses another), one metrics row per step, no
evaluation or checkpoint. The busy processes run for the whole run but are stopped
(SIGSTOP) and resumed (SIGCONT) in turns of ``--phase`` steps, so that the steps alone
and the steps beside them interleave in time: load from elsewhere on a shared machine
weighs on both alike. A step counts for a phase only if it began and ended inside it;
the first steps (warm-up) count for neither. Rounds alternate the settings' order.

On a machine that also runs other work, "alone" is not idle, and the fair ratio is less
than 2.5: the bench samples the machine's runnable tasks (/proc/loadavg) during each
phase and prints, next to the measured ratio, the one a fair share of the CPUs among
them gives, and the measured over the fair one (1.0: the run lost exactly its share;
the goal is at most 4 / 2.5 = 1.6).

    python -m bench.oversubscribe [--rounds 2] [--busy 3] [--phase 3] [--turns 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARM_UP_STEPS = 3  # the first steps allocate and warm caches

# name -> variables added to the command's environment. libgomp (the OpenMP of torch's
# CPU wheels) spins GOMP_SPINCOUNT times before a waiting thread sleeps: 300000 when
# OMP_WAIT_POLICY is unset (libgomp's default, what the launcher left before it chose
# one), 0 with PASSIVE.
SETTINGS = {
    "libgomp default (spin 300000)": {"GOMP_SPINCOUNT": "300000"},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
    "the launcher's default": {},
}


class Busy:
    """``count`` processes that only spin, paused and resumed together, ended by PID."""

    def __init__(self, count: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(count)]
        self.running = True

    def set(self, running: bool) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGCONT if running else signal.SIGSTOP)
        self.running = running

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def command(out: Path) -> list[str]:
    return [sys.executable, str(ROOT / "entrypoint.py"), "train",
            str(ROOT / "configs" / "quickstart.yaml"), f"output.dir={out}",
            "train.max_steps=100000", "logging.every_steps=1", "logging.progress=plain",
            "logging.tensorboard=false", "train.eval_every_steps=0", "checkpoint.every_steps=0"]


@dataclass
class Run:
    """One run's step times and the machine's runnable tasks, alone (False) and beside the
    busy processes (True)."""
    steps: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})
    runnable: dict[bool, list[int]] = field(default_factory=lambda: {False: [], True: []})

    def ratio(self) -> float:
        return statistics.median(self.steps[True]) / statistics.median(self.steps[False])

    def fair(self, cpus: int | None = None) -> float:
        """The ratio a fair share of the CPUs gives: the CPUs are shared by every runnable
        task, the run's own threads and whatever else the machine runs included, so each
        phase's step takes (runnable tasks / CPUs) of an idle one, at least 1x."""
        cpus = cpus or len(os.sched_getaffinity(0))
        load = {k: max(1.0, statistics.mean(v) / cpus) for k, v in self.runnable.items()}
        return load[True] / load[False]


def runnable_tasks() -> int:
    """Tasks running or waiting for a CPU now, machine-wide, less this one reading."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0]) - 1


def one_run(variables: dict[str, str], out: Path, busy_count: int, phase_steps: int,
            turns: int, budget_s: float) -> Run:
    """Alone and beside the busy processes, in turns, in one run of the quick start."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))}
    busy = Busy(busy_count)
    busy.set(False)
    out.mkdir(parents=True)
    log = out / "output.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(command(out), cwd=ROOT, env={**env, **variables},
                                stdout=sink, stderr=subprocess.STDOUT)
    metrics = out / "quickstart" / "metrics.jsonl"
    phases: list[tuple[bool, float]] = []  # (busy running, since): the last one is open
    run = Run()
    try:
        deadline = time.monotonic() + budget_s
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            steps = _steps(metrics)
            if len(steps) < WARM_UP_STEPS:
                continue
            if not phases:
                phases.append((False, time.time()))
            run.runnable[busy.running].append(runnable_tasks())
            if len(_split(steps, phases)[busy.running]) >= phase_steps * (len(phases) + 1) // 2:
                if len(phases) >= 2 * turns:
                    break
                busy.set(not busy.running)
                phases.append((busy.running, time.time()))
    finally:
        busy.close()
        stop(proc)
    run.steps = _split(_steps(metrics), phases)
    print("  phases (ms): " + "  ".join(
        f"{'beside' if running else 'alone'} {statistics.median(t) * 1000:.0f}"
        for running, t in _by_phase(_steps(metrics), phases) if t), flush=True)
    if not all(run.steps.values()) or not all(run.runnable.values()):
        sys.exit(f"too few steps from {' '.join(command(out))} (exit {proc.returncode}):\n"
                 f"{log.read_text()[-3000:]}")
    return run


def stop(proc: subprocess.Popen) -> None:
    """As a user would: SIGTERM (the launcher stops its worker), SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _steps(metrics: Path) -> list[tuple[float, float]]:
    """(began, ended) of each step, wall clock."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return []
    rows = [json.loads(line) for line in lines if line.endswith("}")]
    return [(r["time"] - r["step_time_s"], r["time"]) for r in rows if "loss" in r]


def _split(steps: list[tuple[float, float]], phases: list[tuple[bool, float]]
           ) -> dict[bool, list[float]]:
    """Each step's time under the phase it began and ended in (straddling ones: none)."""
    out: dict[bool, list[float]] = {False: [], True: []}
    for running, times in _by_phase(steps, phases):
        out[running] += times
    return out


def _by_phase(steps: list[tuple[float, float]], phases: list[tuple[bool, float]]
              ) -> list[tuple[bool, list[float]]]:
    bounds = [*(since for _, since in phases), float("inf")]
    return [(running, [end - begin for begin, end in steps if since <= begin and end < until])
            for (running, since), until in zip(phases, bounds[1:], strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--busy", type=int, default=3, help="spinning processes beside the run")
    parser.add_argument("--phase", type=int, default=3, help="steps per phase, at least")
    parser.add_argument("--turns", type=int, default=3, help="phases alone (and beside) per run")
    parser.add_argument("--budget", type=float, default=300, help="seconds per run, at most")
    parser.add_argument("--only", nargs="*", help="settings to run (names as printed)")
    args = parser.parse_args()
    # SIGTERM ends the bench through its finally blocks: the busy processes and the run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    names = [n for n in SETTINGS if not args.only or n in args.only]
    runs: dict[str, list[Run]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                run = one_run(SETTINGS[name], Path(tmp) / f"{round_}-{names.index(name)}",
                              args.busy, args.phase, args.turns, args.budget)
                runs[name].append(run)
                alone, beside = (statistics.median(run.steps[k]) for k in (False, True))
                print(f"round {round_ + 1} {name:30s} alone {alone * 1000:7.1f} ms, beside "
                      f"{args.busy} busy {beside * 1000:8.1f} ms: {run.ratio():5.2f}x (fair "
                      f"{run.fair():.2f}x; runnable tasks alone "
                      f"{statistics.mean(run.runnable[False]):.1f}, beside "
                      f"{statistics.mean(run.runnable[True]):.1f})", flush=True)
    report(names, runs, args.busy)


def report(names: list[str], runs: dict[str, list[Run]], busy_count: int) -> None:
    cpus = len(os.sched_getaffinity(0))
    print(f"\nthe quick start beside {busy_count} busy processes on {cpus} CPUs: step time over "
          f"its own alone in the same run, and that over a fair share's (the CPUs shared by "
          f"every runnable task; on an idle machine {(cpus + busy_count) / cpus:.1f}x); "
          "medians of rounds, each round's in brackets; the last column: the step alone "
          "against the first setting's")
    print(f"  {'setting':30s}{'alone':>10}{'beside':>11}{'ratio':>8}{'of fair':>9}  rounds")
    reference = statistics.median(statistics.median(r.steps[False]) for r in runs[names[0]])
    for name in names:
        alone = statistics.median(statistics.median(r.steps[False]) for r in runs[name])
        beside = statistics.median(statistics.median(r.steps[True]) for r in runs[name])
        ratios = [r.ratio() for r in runs[name]]
        of_fair = [r.ratio() / r.fair() for r in runs[name]]
        print(f"  {name:30s}{alone * 1000:8.1f}ms{beside * 1000:9.1f}ms"
              f"{statistics.median(ratios):7.2f}x{statistics.median(of_fair):8.2f}x  "
              f"{_listed(ratios)} {_listed(of_fair)}  {alone / reference:.2f}")


def _listed(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


if __name__ == "__main__":
    main()
