"""Start-up: what a user waits for, from the command to the end of the first optimizer
step, for the trainer against a plain hand-written DDP script (bench/plain_ddp.py: the
same model, data, optimizer and batch), both started by plain torchrun (2 processes,
gloo, 127.0.0.1) on the config of bench/ddp_overhead.py, in rounds that alternate the
order. The trainer's own command (`entrypoint.py train`, torchrun behind the launcher's
checks) is timed in the same rounds.

A run's clock starts when its command is started and stops at the line rank 0 prints
right after its first optimizer step (the trainer's "step 1/", the plain script's
"plain: step 1 done"); the process tree is killed there. Besides the wall time, the CPU
time (user + system) of every process of the tree up to that line, read from /proc:
under load the wall time swings with the other jobs, the CPU time much less. Phases,
where the output shows them: the launcher's checks (to "entrypoint: run"), the
workers' start (python, imports, process group, data, model, optimizer, resume: to the
plain script's "plain: ready" or the trainer's "INFO model" line), the first step. The
ratios, each against torchrun + the plain script: the trainer under plain torchrun, and
the trainer's own command.

The project's modules are byte-compiled first, as a pip install and the images do: in a
shell with PYTHONDONTWRITEBYTECODE set, every process would compile them from source at
each start (the launcher, torchrun's agent, each worker), a cost of the checkout that no
installed copy pays and the one-file plain script hardly has.

    python -m bench.startup [--rounds 3]
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.ddp_overhead import ROOT, bench_config
from tests.harness.procs import descendants

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2"]
READY, FIRST_STEP = "workers start", "first step"
PLAIN_MARKS = {READY: r"^plain: ready", FIRST_STEP: r"^plain: step 1 done"}
# behind the launcher, torchrun's --tee prefixes each line with "[default0]:"
TRAINER_MARKS = {READY: r"INFO model ", FIRST_STEP: r"^(\[default\d+\]:)?step 1/"}
COMMAND_MARKS = {"launcher checks": r"^entrypoint: run ", **TRAINER_MARKS}
TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """User + system seconds of ``root`` and every live process below it, with the
    children each of them has already waited for (a stat's cutime and cstime)."""
    total = 0
    for pid in {root} | descendants(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone since the walk: what it used is lost (a few ms at most)
        total += sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    return total / TICKS


def end_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to the command and every process below it (the launcher starts torchrun
    in a process group of its own), then wait until all are gone: nothing of one run may
    load the next."""
    tree = descendants(proc.pid)
    for pid in (proc.pid, *tree):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60
    while any(map(alive, tree)) and time.monotonic() < deadline:
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Running, or dying: not gone, and not a zombie (one waits for its reaper only)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def timed(cmd: list[str], marks: dict[str, str], env: dict) -> dict[str, float]:
    """Seconds from start to the first line matching each mark; the last mark ends the
    run, and its CPU seconds (the whole tree's) are under "cpu"."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: dict[str, float] = {}
    last = list(marks)[-1]
    for line in proc.stdout:
        for name, pattern in marks.items():
            if name not in seen and re.search(pattern, line):
                seen[name] = time.monotonic() - start
        if last in seen:
            seen["cpu"] = tree_cpu_s(proc.pid)
            break
    end_tree(proc)
    proc.stdout.close()
    if last not in seen:
        sys.exit(f"no {marks[last]!r} from {' '.join(cmd)}")
    return seen


def commands(config: Path, round_: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    return {
        "torchrun + plain DDP script": (
            [*TORCHRUN, str(ROOT / "bench" / "plain_ddp.py"), str(config), "0"],
            PLAIN_MARKS),
        "torchrun + trainer (-m train)": (
            [*TORCHRUN, "-m", "train", str(config), f"run.name=torchrun-{round_}"],
            TRAINER_MARKS),
        "entrypoint.py train": (
            [sys.executable, str(ROOT / "entrypoint.py"), "train", str(config),
             f"run.name=entry-{round_}", "distributed.nproc_per_node=2"], COMMAND_MARKS),
    }


def report(runs: dict[str, list[dict[str, float]]]) -> None:
    rounds = len(next(iter(runs.values())))
    print(f"command -> end of the first optimizer step, 2 processes, medians of {rounds} "
          "rounds (wall s, CPU s of the whole process tree):")
    for name, rows in runs.items():
        wall = statistics.median(r[FIRST_STEP] for r in rows)
        cpu = statistics.median(r["cpu"] for r in rows)
        print(f"  {name:32s}{wall:7.2f} s wall {cpu:7.2f} s CPU")
        before = 0.0
        for mark in rows[0]:
            if mark == "cpu":
                continue
            at = statistics.median(r[mark] for r in rows)
            print(f"    {mark:30s}{at - before:7.2f} s")
            before = at
    plain = runs["torchrun + plain DDP script"]
    for what, ours in (("trainer/plain under torchrun", runs["torchrun + trainer (-m train)"]),
                       ("entrypoint.py train/torchrun + plain", runs["entrypoint.py train"])):
        for kind in (FIRST_STEP, "cpu"):
            ratio = statistics.median(r[kind] for r in ours) / \
                statistics.median(r[kind] for r in plain)
            label = "wall" if kind == FIRST_STEP else "CPU"
            print(f"  ratio {what}, {label:4s} {ratio:6.2f} (target <= 1.05)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    runs: dict[str, list[dict[str, float]]] = {}
    for package in ("launcher", "train", "bench"):  # see the module's docstring
        compileall.compile_dir(ROOT / package, quiet=1)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        config = bench_config(Path(tmp), 5)
        for round_ in range(args.rounds):
            todo = list(commands(config, round_).items())
            for name, (cmd, marks) in todo if round_ % 2 == 0 else todo[::-1]:
                runs.setdefault(name, []).append(timed(cmd, marks, env))
            print(f"round {round_ + 1}: " + ", ".join(
                f"{name} {rows[-1][FIRST_STEP]:.2f} s ({rows[-1]['cpu']:.2f} CPU-s)"
                for name, rows in runs.items()), flush=True)
    report(runs)


if __name__ == "__main__":
    main()
