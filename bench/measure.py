"""Run a benchmark's command and measure its whole process tree: the CPU time (user +
system) of every process in it, and the largest resident set among them. Both come from
the kernel's accounting of waited-for children (getrusage RUSAGE_CHILDREN), read by a
small parent of its own so that earlier runs of the bench do not count."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_PROBE = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
          "r = resource.getrusage(resource.RUSAGE_CHILDREN); "
          "print('USAGE', r.ru_utime + r.ru_stime, r.ru_maxrss, file=sys.stderr); "
          "sys.exit(p.returncode)")


@dataclass(frozen=True)
class Measured:
    stdout: str
    cpu_s: float        # user + system of every process of the tree
    max_rss_bytes: int  # the largest single process


def measured(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 3600) -> Measured:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *cmd], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    cpu, rss = proc.stderr.rsplit("USAGE", 1)[1].split()[:2]
    return Measured(proc.stdout, float(cpu), int(rss) * 1024)
