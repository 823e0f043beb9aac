"""The run directory's layout: every fixed name in it is defined here, once.

``output.dir/run.name/`` holds what a run keeps (:data:`LAYOUT`, the names
docs/training.md's table lists: a test holds the two together, and another that no
product module spells one of these names itself). Its checkpoints are
``checkpoints/step-N/`` folders, each complete once its ``checksums.json`` lists every
file, and ``checkpoints/latest`` naming the newest.

Here is also what reading the checkpoints needs and costs no hashing: which step
folders exist, which one ``latest`` names, and whether a folder has its files. The
launcher asks :func:`usable_problem` before it starts any worker (checkpoints there,
none whole: exit 2, never a silent start over); writing, verifying and loading are
:mod:`train.checkpoint`'s.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

log = logging.getLogger("train")

# In the run directory
CONFIG = "config.yaml"            # the resolved config
MANIFEST = "manifest.json"        # versions, hashes and one entry per (re)start
METRICS = "metrics.jsonl"         # one JSON object per logged step
BOARD = "tb"                      # TensorBoard events
RESULT = "result.json"            # final step and validation metrics
TRACKERS = "trackers.json"        # the experiment trackers' run ids
WANDB = "wandb"                   # W&B's own offline files
DIVERGED = "diverged.json"        # the message of a run that diverged
PREFLIGHT = "preflight.json"      # the multi-node preflight checks' measurements
TOKEN_IDS = "token-ids.json"      # each token file's largest id, so restarts skip the scan
LEDGER = "ledger.jsonl"           # replica groups: one line per committed step, its samples
LOCK = ".lock"                    # the run directory's lease
FLOCK = ".flock"                  # flock'ed by the run's processes on the holder's host
LOGS = "logs"                     # torchrun's per-rank logs
EXPORT = "export"                 # entrypoint.py export's default output
CHECKPOINTS = "checkpoints"
# Beside checkpoints/: checkpoints moved aside, never deleted
REPLACED = "replaced"             # by checkpoint.resume_from: none
ABANDONED = "abandoned"           # newer than the one a run resumed from
# In checkpoints/
LATEST = "latest"                 # the name of the newest sealed checkpoint
STEP_DIR = re.compile(r"^step-(\d+)$")
# In checkpoints/step-N/
STATE_FILE = "state.pt"           # shared state: model, optimizer, schedule, position, config
CHECKSUMS = "checksums.json"      # every file's SHA-256: written last, it seals the folder
SHARDS = "model"                  # a sharded checkpoint's model and optimizer (DCP)
# ... and in one node's part of a checkpoint (node-local run directories: the whole one is
# in checkpoint.remote), beside the files of that node's ranks its checksums.json lists
NODE_PART = ".node-part"
# In an export
EXPORT_WEIGHTS = "model.pt"
EXPORT_META = "model.json"


def step_name(step: int) -> str:
    return f"step-{step}"


def rank_file(rank: int) -> str:
    """A checkpoint's per-rank state (RNG streams)."""
    return f"rank-{rank}.pt"


def aside_name(why: str, stamp: str) -> str:
    """``checkpoints.<why>-<stamp>``: a folder of checkpoints moved out of the way."""
    return f"{CHECKPOINTS}.{why}-{stamp}"


# What a run directory may hold, as docs/training.md's table lists it (a test compares).
LAYOUT = (CONFIG, MANIFEST, METRICS, f"{BOARD}/train/", f"{BOARD}/val/",
          f"{CHECKPOINTS}/step-N/", f"{CHECKPOINTS}/{LATEST}",
          f"{aside_name(REPLACED, '<time>')}/", f"{aside_name(ABANDONED, '<time>')}/", RESULT,
          TRACKERS, f"{WANDB}/offline-run-<time>-<id>/", DIVERGED, PREFLIGHT, TOKEN_IDS, LEDGER,
          LOCK, FLOCK, f"{LOGS}/", f"{EXPORT}/")

# Files a run writes at fixed names in its directory (checkpoints/ holds fresh step-N
# folders): none may be a symbolic link, or the run would write where it points.
RUN_FILES = (CONFIG, MANIFEST, METRICS, RESULT, DIVERGED, PREFLIGHT, LEDGER, LOCK, FLOCK,
             f"{CHECKPOINTS}/{LATEST}")


def linked_files(run_dir: Path) -> list[str]:
    """The fixed-name files of ``run_dir`` that are symbolic links."""
    return [name for name in RUN_FILES if (Path(run_dir) / name).is_symlink()]


def check_no_links(run_dir: Path) -> None:
    """ConfigError (exit 2) naming the first fixed-name file that is a link."""
    from train.core.errors import ConfigError
    linked = linked_files(run_dir)
    if linked:
        raise ConfigError(str(run_dir), linked[0], "is a symbolic link; the run writes no "
                                                   "file through a link (it would overwrite "
                                                   "what the link points at): remove it")


def step_of(path: Path) -> int:
    return int(path.name.split("-")[1])


def step_dirs(folder: Path) -> list[Path]:
    """The sealed ``step-N`` folders in ``folder`` (``run_dir/checkpoints``), unordered."""
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]


def is_part(path: Path) -> bool:
    """The checkpoint ``path`` holds one node's part only (:data:`NODE_PART`)."""
    return (path / NODE_PART).exists()


def latest_name(folder: Path) -> str | None:
    """The step folder ``latest`` names; None when it is missing or unreadable (garbage
    in it is ignored with a warning: the newest verified checkpoint wins)."""
    try:
        text = (folder / LATEST).read_bytes()[:256].decode("utf-8", "replace").strip()
    except OSError:
        return None
    if STEP_DIR.match(text):
        return text
    log.warning("%s is unreadable (%r); ignoring it and using the newest checkpoint that "
                "verifies", folder / LATEST, text[:40])
    return None


def candidates(folder: Path) -> list[Path]:
    """Newest first: the one ``latest`` names, then every step-N by step."""
    ordered = sorted(step_dirs(folder), key=step_of, reverse=True)
    named = latest_name(folder)
    if named and folder / named in ordered:
        ordered.remove(folder / named)
        ordered.insert(0, folder / named)
    return ordered


def quick_check(path: Path) -> str | None:
    """What a look at a checkpoint's files (no hashing) finds wrong, or None."""
    if is_part(path):
        return ("one node's part of a checkpoint (a node-local run directory): the whole one "
                "is resumed from checkpoint.remote")
    try:
        sums = json.loads((path / CHECKSUMS).read_text())
    except (OSError, ValueError):
        return "missing or unreadable checksums.json"
    if not isinstance(sums, dict) or STATE_FILE not in sums:
        return f"checksums.json does not list {STATE_FILE}"
    missing = [name for name in sums if not (path / name).is_file()]
    return f"{', '.join(missing)} missing" if missing else None


def usable_problem(folder: Path) -> str | None:
    """The parent's cheap check before a resume: checkpoints exist, but none of them
    even has its files. None when there are none, or one looks whole."""
    found = [p for p in candidates(folder) if not is_part(p)]  # resumed through the store
    problems = [(p.name, quick_check(p)) for p in found]
    if not found or any(problem is None for _, problem in problems):
        return None
    return none_usable(folder, problems)


def none_usable(folder: Path, problems: list[tuple[str, str]]) -> str:
    listed = "; ".join(f"{name}: {problem}" for name, problem in problems[:4])
    more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
    return (f"{folder}: {len(problems)} checkpoint(s) and none is usable ({listed}{more}); "
            "nothing was changed. To start this run over, set checkpoint.resume_from=none "
            f"(they are moved to {aside_name(REPLACED, '<time>')}/, not deleted); to resume one, "
            "restore its files")
