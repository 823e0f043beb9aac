"""``doctor``'s check of the Python packages: what would shadow a locked one.

The trainer is tested with the versions its locks pin. A user adding a package their
code needs can move one of them (``pip install`` without the locks' constraints), and a
module of the user's project named like a package (``./yaml.py``, ``./torch/``) is what
the workers import instead of it, since the project directory comes first on their
``sys.path`` (and ``PYTHONPATH``'s folders, the images' ``/opt/project``, before the
installed packages). Both are said here, one warning each, with what to do.

The pins come from the environment's own constraints file when it has one (the images'
``/opt/venv/constraints.txt``, the checkout's ``.venv/constraints.txt``: every version
installed, written by the image build and by ``make venv``), and from this checkout's
lock for the running Python (``requirements/dev-pyXY.lock``). Standard library only.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

from launcher.detection.hardware import Finding

# What every training process imports, pinned or not in a lock file (torch has its own).
ALWAYS = ("torch",)
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\#]+)")


def normalized(name: str) -> str:
    """A distribution's name as package indexes compare them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of a lock or constraints file (hashes, comments and
    anything else skipped), by normalized name."""
    out: dict[str, str] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return out
    for line in lines:
        m = _PIN.match(line.strip())
        if m:
            out.setdefault(normalized(m.group(1)), m.group(2))
    return out


def lock_files(app_root: Path, prefix: Path | None = None) -> list[Path]:
    """Where the pins come from, those that exist: the environment's constraints file,
    then this checkout's lock for the running Python."""
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    candidates = [Path(prefix or sys.prefix) / "constraints.txt",
                  app_root / "requirements" / f"dev-{py}.lock"]
    return [p for p in candidates if p.is_file()]


def installed() -> dict[str, tuple[str, list[str]]]:
    """normalized name -> (version, its top-level import names)."""
    modules: dict[str, list[str]] = {}
    for module, dists in metadata.packages_distributions().items():
        for dist in dists:
            modules.setdefault(normalized(dist), []).append(module)
    out = {}
    for dist in metadata.distributions():
        name = normalized(dist.metadata["Name"] or "")
        if name and name not in out:
            out[name] = (dist.version, sorted(set(modules.get(name, []))))
    return out


def _same(installed_version: str, pinned: str) -> bool:
    """2.13.0+cpu satisfies a pin of 2.13.0 (a local build label the pin does not name)."""
    return installed_version == pinned or ("+" not in pinned and
                                           installed_version.split("+")[0] == pinned)


def moved(locked: dict[str, str], have: dict[str, tuple[str, list[str]]]) -> list[str]:
    """Installed packages whose version is not the pinned one, as 'name V (pinned W)'."""
    return [f"{name} {have[name][0]} (pinned {version})" for name, version in sorted(locked.items())
            if name in have and not _same(have[name][0], version)]


def shadowing(project: Path, locked: dict[str, str],
              have: dict[str, tuple[str, list[str]]], shown_as: str = ".") -> list[str]:
    """The modules of a folder the workers import from (the project folder, a
    ``PYTHONPATH`` entry) named like a module of a locked package (a file, or a folder
    with ``__init__.py``: a folder without one does not hide an installed package), as
    './yaml.py (hides pyyaml)'; ``shown_as`` names the folder."""
    out = []
    for name in sorted(set(locked) | set(ALWAYS)):
        for module in have.get(name, ("", []))[1] or ([name] if name in ALWAYS else []):
            for path in (project / f"{module}.py", project / module / "__init__.py"):
                if path.is_file():
                    shown = path.name if path.name != "__init__.py" else f"{module}/"
                    out.append(f"{shown_as}/{shown} (hides {name})")
    return out


def import_folders(project: Path, pythonpath: str | None, app_root: Path) -> list[Path]:
    """Where the workers find the user's modules before the installed packages: the
    project folder (first on their sys.path), then PYTHONPATH's entries (the images'
    /opt/project), this checkout or /app aside."""
    folders = [project]
    for entry in (pythonpath or "").split(":"):
        path = Path(entry) if entry else None
        if path and path.is_dir() and path.resolve() not in {f.resolve() for f in folders} \
                and path.resolve() != app_root.resolve():
            folders.append(path)
    return folders


def findings(app_root: Path, project: Path, prefix: Path | None = None,
             pythonpath: str | None = None) -> tuple[dict, list[Finding]]:
    """doctor's report of the packages and its findings."""
    sources = lock_files(app_root, prefix)
    locked: dict[str, str] = {}
    for source in sources:
        for name, version in pins(source).items():
            locked.setdefault(name, version)
    have = installed()
    drift = moved(locked, have)
    hidden = [line for folder in import_folders(project, pythonpath, app_root)
              for line in shadowing(folder, locked, have,
                                    "." if folder == project else str(folder))]
    report = {"locks": [str(s) for s in sources], "moved": drift, "shadowed": hidden}
    out = []
    if drift:
        out.append(Finding("warn", "packages", f"installed versions differ from the pins of "
                           f"{', '.join(map(str, sources))}: {', '.join(drift)}",
                           "reinstall the pinned versions (make venv; in an image, rebuild "
                           "it), and add packages under the pins: pip install -c "
                           f"{sources[0]} PACKAGE"))
    if hidden:
        out.append(Finding("warn", "packages", f"modules of the project folder {project} (or "
                           "of PYTHONPATH) are named like installed packages, which the "
                           f"workers would import instead: {', '.join(hidden)}",
                           "rename them"))
    if not out and sources:
        out.append(Finding("ok", "packages", f"{len(locked)} pinned packages as locked "
                           f"({', '.join(map(str, sources))}); none hidden by the project"))
    return report, out
