"""Reports that supervised processes leave for the launcher: one small JSON file each.

torchrun ends with exit 1 and a traceback both when a worker fails and when it is
stopped by SIGTERM, and a hung process says nothing at all. So each training worker
(``train.worker``) and each ``doctor --comm`` process writes a :class:`Report` into
the folder the launcher gives it (``TRAIN_LAUNCHER_STATUS_DIR``): how it ended, or the
stage it reached. The launcher reads them back to choose the exit code and to name
the failing or silent rank in one line. Writing a report never raises.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.core.files import write_json_atomic


@dataclass
class Report:
    rank: int
    kind: str = "rank"                  # rank (training worker) | comm (doctor --comm)
    local_rank: int = 0
    restart: int = 0                    # torchrun's restart round
    exit_code: int | None = None        # how a training worker ended
    error: str | None = None            # one line
    log_dir: str | None = None          # where the rank's full log is
    stage: str | None = None            # comm: start | init | allreduce | done | error
    details: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None       # the run's newest checkpoint when it ended
    pid: int = field(default_factory=os.getpid)
    time: float = field(default_factory=time.time)

    def path_in(self, folder: str | Path) -> Path:
        """One file per local process: a rendezvous round after a membership change
        renumbers the ranks (without a restart count), and every local worker of the
        new round replaces the file of its local rank, so no report of an earlier
        round survives as if it were this one's."""
        slot = self.local_rank if self.kind == "rank" else self.rank
        return Path(folder) / f"{self.kind}-{slot}.json"


FAILURES = "failures.jsonl"


def record_failure(folder: str | Path | None, report: Report) -> None:
    """Keep every failure of the launch (the reports are replaced each round): how a
    restart tells a failure that repeats from one a restart fixed."""
    if not folder:
        return
    line = json.dumps({"restart": report.restart, "rank": report.rank,
                       "error": report.error, "checkpoint": report.checkpoint,
                       "hung": report.details.get("hung"), "log_dir": report.log_dir})
    try:
        with open(Path(folder) / FAILURES, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        pass


def failures(folder: str | Path) -> list[dict]:
    try:
        lines = (Path(folder) / FAILURES).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def write(folder: str | Path | None, report: Report) -> None:
    """Replace this process's report (atomically; a reader never sees half of one)."""
    if not folder:
        return
    if report.error:
        report.error = " ".join(report.error.split())[:500]
    try:
        write_json_atomic(report.path_in(folder), dataclasses.asdict(report), durable=False)
    except OSError:
        pass  # reporting must never turn a result into a crash


def read_all(folder: str | Path, kind: str = "rank") -> list[Report]:
    """Every readable report of ``kind`` in ``folder``, sorted by rank."""
    names = {f.name for f in dataclasses.fields(Report)}
    out = []
    for path in Path(folder).glob(f"{kind}-*.json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            out.append(Report(**{k: v for k, v in data.items() if k in names}))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(out, key=lambda r: r.rank)


def latest_round(reports: list[Report]) -> list[Report]:
    """Elastic restarts renumber ranks: keep only the last restart round's reports."""
    if not reports:
        return []
    last = max(r.restart for r in reports)
    return [r for r in reports if r.restart == last]
