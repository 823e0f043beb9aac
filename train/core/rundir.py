"""The run directory's checkpoint layout, read the same way by the launcher and the workers.

``checkpoints/step-N/`` folders, each complete once its ``checksums.json`` lists every
file, and ``checkpoints/latest`` naming the newest, beside the run's other files (:data:`RUN_FILES`,
none of which may be a symbolic link). Here is only what reading needs
and costs no hashing: which step folders exist, which one ``latest`` names, and
whether a folder has its files. The launcher asks :func:`usable_problem` before it
starts any worker (checkpoints there, none whole: exit 2, never a silent start over);
writing, verifying and loading are :mod:`train.checkpoint`'s.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

log = logging.getLogger("train")

STATE_FILE = "state.pt"
CHECKSUMS = "checksums.json"
STEP_DIR = re.compile(r"^step-(\d+)$")


# Files a run writes at fixed names in its directory (checkpoints/ holds fresh step-N
# folders): none may be a symbolic link, or the run would write where it points.
RUN_FILES = ("config.yaml", "manifest.json", "metrics.jsonl", "result.json", "diverged.json",
             ".lock", ".flock", "checkpoints/latest")


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


def latest_name(folder: Path) -> str | None:
    """The step folder ``latest`` names; None when it is missing or unreadable (garbage
    in it is ignored with a warning: the newest verified checkpoint wins)."""
    try:
        text = (folder / "latest").read_bytes()[:256].decode("utf-8", "replace").strip()
    except OSError:
        return None
    if STEP_DIR.match(text):
        return text
    log.warning("%s is unreadable (%r); ignoring it and using the newest checkpoint that "
                "verifies", folder / "latest", text[:40])
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
    found = candidates(folder)
    problems = [(p.name, quick_check(p)) for p in found]
    if not found or any(problem is None for _, problem in problems):
        return None
    return none_usable(folder, problems)


def none_usable(folder: Path, problems: list[tuple[str, str]]) -> str:
    listed = "; ".join(f"{name}: {problem}" for name, problem in problems[:4])
    more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
    return (f"{folder}: {len(problems)} checkpoint(s) and none is usable ({listed}{more}); "
            "nothing was changed. To start this run over, set checkpoint.resume_from=none "
            "(they are moved to checkpoints.replaced-<time>/, not deleted); to resume one, "
            "restore its files")
