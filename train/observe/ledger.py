"""``RUN_DIR/ledger.jsonl``: which samples each committed step of replica groups trained.

One line per committed step, ``{"step": N, "samples": [[lo, hi], ...], "replicas": [...]}``:
the positions ``[lo, hi)`` of the run's sample order (:mod:`train.data.order`) that step
trained, and the replica groups that computed them. A step that failed anywhere is not
committed, so it has no line; it is trained again, on the same samples, and then has one.
Read in order, the lines cover every sample the run trained exactly once.

One process writes: rank 0 of the step's first participating group. Every group's rank 0
remembers its recent committed steps, so that a writer that takes over (the previous one
was lost after a commit, before its line) first writes the lines the file lacks. Each
line is one ``write`` to a file opened for appending: a writer killed mid-run leaves whole
lines (a torn last line is dropped when the file is next read).

A run that restarts from a checkpoint (every group resumed, no live group ahead of it)
trains the steps after that checkpoint again: its writer first drops their lines
(:meth:`Ledger.restart_at`), so the ledger continues from the checkpoint's step.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from train.core.files import fsync_file, open_append, write_atomic
from train.core.run import rundir


@dataclass(frozen=True)
class Entry:
    step: int
    samples: list[list[int]]
    replicas: list[int]

    def line(self) -> str:
        return json.dumps({"step": self.step, "samples": self.samples,
                           "replicas": self.replicas}, separators=(", ", ": ")) + "\n"


def read(path: Path) -> list[Entry]:
    """The whole lines of a ledger, in order (a torn or foreign line is skipped)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            continue  # the last line of a writer killed while writing it
        try:
            raw = json.loads(line)
            out.append(Entry(int(raw["step"]), raw["samples"], raw["replicas"]))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _torn(path: Path) -> bool:
    """The file ends inside a line (its writer was killed while writing it)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            if f.tell() == 0:
                return False
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


class Ledger:
    """One group rank 0's view of the ledger: what it committed, and, while it is the
    writer, what the file holds."""

    def __init__(self, path: Path, keep: int = 10_000):
        self.path = Path(path)
        self.recent: deque[Entry] = deque(maxlen=keep)  # committed here, maybe not written
        self._written: int | None = None  # the file's last step, while we are the writer
        self._size = 0  # the file's size after our last write: another writer changes it

    def committed(self, entry: Entry) -> None:
        self.recent.append(entry)

    # What a heal carries: plain values only (it is read weights_only).
    HEALED = 1000

    def recent_entries(self) -> list[dict]:
        """The newest committed steps, for a group that heals from this one."""
        return [{"step": e.step, "samples": e.samples, "replicas": e.replicas}
                for e in list(self.recent)[-self.HEALED:]]

    def adopt(self, entries: list[dict]) -> None:
        """A healed group's history is its peer's: the steps the peer committed that this
        group did not (its own failed, the peer's went through) become its own."""
        last = self.recent[-1].step if self.recent else -1
        for raw in entries:
            if int(raw["step"]) > last:
                self.recent.append(Entry(int(raw["step"]), raw["samples"], raw["replicas"]))

    def restart_at(self, step: int) -> None:
        """A run restarted from the checkpoint of ``step``: the lines after it describe
        steps that are trained again, so they go."""
        kept = [e for e in read(self.path) if e.step <= step]
        if self.path.exists():
            write_atomic(self.path, "".join(e.line() for e in kept))
        self._written = kept[-1].step if kept else None
        self._size = _size(self.path)

    def write(self, *, durable: bool = False) -> None:
        """As the writer: append the committed steps the file lacks. ``durable``: fsync
        too (before a checkpoint that covers them is sealed). The file is read again
        whenever it changed since this writer's last line: a group that was left out of
        some quorums (slow, or healing) may have missed steps another writer wrote."""
        if self._written is None or _size(self.path) != self._size:
            entries = read(self.path)
            if _torn(self.path):  # a line appended now would join the torn piece
                write_atomic(self.path, "".join(e.line() for e in entries))
            self._written = entries[-1].step if entries else 0
        missing = [e for e in self.recent if e.step > self._written]
        if missing:
            with open_append(self.path) as f:
                for entry in missing:
                    f.write(entry.line())  # line-buffered: one write() per line
                    self._written = entry.step
        self._size = _size(self.path)
        if durable and self.path.exists():
            fsync_file(self.path)

    def step_down(self) -> None:
        """No longer the writer: another group's rank 0 may append meanwhile."""
        self._written = None


def check_exactly_once(entries: list[Entry], first: int = 0) -> list[str]:
    """What is wrong with a ledger's coverage of the samples from ``first`` on: steps out
    of order, and positions missing or trained twice. Empty when every position from
    ``first`` to the last one appears exactly once (the tests' and ``doctor``'s check)."""
    problems, expected, step = [], first, None
    for e in entries:
        if step is not None and e.step != step + 1:
            problems.append(f"step {e.step} follows step {step}")
        step = e.step
        for lo, hi in e.samples:
            if lo != expected:
                what = "missing" if lo > expected else "trained twice"
                problems.append(f"step {e.step}: positions {min(lo, expected)}.."
                                f"{max(lo, expected)} {what}")
            expected = max(expected, hi)
    return problems


def ledger_path(run_dir: Path) -> Path:
    return Path(run_dir) / rundir.LEDGER
