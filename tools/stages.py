"""Named stages with time limits, each recorded the moment it ends.

A machine lent for minutes can be taken back mid-check, so nothing waits for the end:
after every stage ``stages.jsonl`` gains a line, ``summary.txt`` is rewritten and the
stage's output is appended to ``logs.txt``, all in the output folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

TIMED_OUT = 124  # as timeout(1) says it


@dataclass
class Result:
    name: str
    rc: int
    seconds: float
    ok: bool
    note: str = ""
    skipped: bool = False


def summary_lines(rows: list[Result], elapsed_s: float, title: str) -> list[str]:
    lines = [f"{title}: {len(rows)} stage(s), {elapsed_s:.0f} s so far"]
    for r in rows:
        verdict = "ok" if r.ok else ("SKIP" if r.skipped else "FAIL")
        lines.append(f"{r.name:<8} {verdict:<5} rc={r.rc:<4} {r.seconds:>5.1f}s  {r.note}")
    return lines


class Recorder:
    """The output folder of one check: stages.jsonl, summary.txt, logs.txt."""

    def __init__(self, out: Path, title: str) -> None:
        self.out, self.title = out, title
        out.mkdir(parents=True, exist_ok=True)
        self.rows: list[Result] = []
        self.started = time.monotonic()
        for name in ("stages.jsonl", "logs.txt"):
            (out / name).write_text("")

    @property
    def failed(self) -> bool:
        return any(not r.ok and not r.skipped for r in self.rows)

    def record(self, result: Result) -> Result:
        self.rows.append(result)
        with (self.out / "stages.jsonl").open("a") as f:
            f.write(json.dumps(asdict(result)) + "\n")
        (self.out / "summary.txt").write_text(
            "\n".join(summary_lines(self.rows, time.monotonic() - self.started, self.title))
            + "\n")
        return result

    def log(self, header: str, text: str) -> None:
        with (self.out / "logs.txt").open("a") as f:
            f.write(f"\n===== {header}\n{text}")

    def summary(self) -> str:
        return (self.out / "summary.txt").read_text()


def run_limited(argv: Sequence[str], limit_s: float, *, cwd: Path | None = None,
                env: dict[str, str] | None = None) -> tuple[int, str]:
    """(exit code, output) of a command given ``limit_s`` seconds; past it, the whole
    process group gets SIGTERM, then SIGKILL 10 s later, and the code is 124."""
    proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        stop_group(proc)
        out, _ = proc.communicate()
        return TIMED_OUT, out + f"\n[stopped after the {limit_s:.0f} s limit]\n"


def stop_group(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM to the process group of ``proc`` (its own session), SIGKILL after grace."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
