"""``make venv``'s torch install: pip's own output when it works, one line when it cannot.

torch comes from the PyTorch index (its CPU build is not on PyPI for Linux). On a
machine that cannot reach that index, pip retries each URL, prints a page of warnings
and ends with ``No matching distribution found``, which reads as if the version did
not exist. Here the full output goes to a log file and the user reads one line: the
index could not be reached (or it has no such build), and what to set instead.

    python tools/install_torch.py PYTHON LOG SPEC INDEX_URL [pip options...]

INDEX_URL may be empty (the PyPI route: ``TORCH_VARIANT=pypi``). Exit 0, or 3 with
the line on stderr.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

# pip's words (through urllib3/requests) for an index it could not talk to
_UNREACHABLE = re.compile(
    r"Could not fetch URL|Failed to establish a new connection|Max retries exceeded|"
    r"Name or service not known|Temporary failure in name resolution|"
    r"Connection refused|ProxyError|SSLError|Read timed out|Network is unreachable")
ALTERNATIVES = (
    "TORCH_INDEX_URL=<a mirror of it>; TORCH_SPEC=<a torch wheel file or URL>; or "
    "TORCH_VARIANT=pypi (PyPI's torch: the CUDA build on Linux, several GB); see "
    "docs/development.md, 'Installing torch'")


def pip_command(python: str, spec: str, index_url: str, options: list[str]) -> list[str]:
    index = ["--extra-index-url", index_url] if index_url else []
    return [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
            *options, *index, spec]


def diagnose(output: str, spec: str, index_url: str) -> str:
    """The one line for a failed install, from pip's output."""
    where = index_url or "PyPI"
    unreachable = _UNREACHABLE.search(output)
    if not unreachable and "(from versions: none)" in output:
        refused = _probe(index_url or "https://pypi.org/simple")  # pip retried silently
        if refused:
            return (f"make venv: cannot reach {where} to install {spec} ({refused}); set "
                    f"{ALTERNATIVES}")
    if unreachable:
        host = urlsplit(index_url).netloc if index_url else "pypi.org"
        lines = [line for line in output.splitlines() if host and host in line] or \
            [line for line in output.splitlines() if _UNREACHABLE.search(line)]
        reason = _reason(lines[0]) if lines else "no connection"
        return (f"make venv: cannot reach {where} to install {spec} ({reason}); set "
                f"{ALTERNATIVES}")
    if "No matching distribution found" in output or "ResolutionImpossible" in output:
        return (f"make venv: {where} has no {spec} for this Python and platform "
                f"({_platform()}); check TORCH_VERSION/TORCH_VARIANT, or set {ALTERNATIVES}")
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()),
                "no output")
    return f"make venv: pip could not install {spec}: {last}"


_REASONS = ("Connection refused", "Name or service not known",
            "Temporary failure in name resolution", "Network is unreachable", "Read timed out",
            "ProxyError", "SSLError", "Failed to establish a new connection")


def _reason(line: str) -> str:
    """The most specific cause pip's line names."""
    words = next((w for w in _REASONS if w in line), "no connection")
    return words if words.endswith("Error") else words[0].lower() + words[1:]


def _probe(url: str) -> str | None:
    """Why a TCP connection to the index's host fails, or None (it connects, or the
    index is a local folder)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=10).close()
    except OSError as exc:
        return (exc.strerror or str(exc) or "no connection").lower()
    return None


def _platform() -> str:
    import platform
    return f"Python {platform.python_version()}, {platform.system()} {platform.machine()}"


def main(argv: list[str]) -> int:
    python, log, spec, index_url, *options = argv
    proc = subprocess.run(pip_command(python, spec, index_url, options),
                          capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode == 0:
        sys.stdout.write(output)
        return 0
    Path(log).write_text(output, encoding="utf-8")
    print(f"{diagnose(output, spec, index_url)} (pip's output: {log})", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
