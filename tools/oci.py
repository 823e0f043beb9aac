"""A container engine (docker or podman) as the image test drives it, and the helpers
every step shares: one-line failures, timed log lines, commands that must succeed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STARTED = time.monotonic()


class Failed(Exception):
    """One line saying what failed; the test stops there."""


def log(message: str) -> None:
    print(f"\n== [{time.monotonic() - STARTED:4.0f}s] {message}", file=sys.stderr, flush=True)


def sh(*argv: str, capture: bool = False, check: bool = True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), text=True, capture_output=capture, **kw)
    if check and out.returncode:
        raise Failed(f"{shlex.join(argv[:4])}... exited {out.returncode}"
                     + (f": {out.stderr.strip()[-500:]}" if capture else ""))
    return out


@dataclass
class Engine:
    """docker or podman, with the flags this machine needs."""
    name: str
    build_flags: list[str] = field(default_factory=list)
    run_flags: list[str] = field(default_factory=list)
    tmp_flags: list[str] = field(default_factory=list)   # a writable /tmp on --read-only

    @classmethod
    def from_environ(cls, env: dict[str, str]) -> Engine:
        name = env.get("OCI_ENGINE") or "docker"
        engine = cls(name, shlex.split(env.get("OCI_BUILD_FLAGS", "")),
                     shlex.split(env.get("OCI_RUN_FLAGS", "")))
        if name == "podman":
            engine.build_flags.append("--format=docker")  # keeps SHELL (pipefail) as docker
            engine.build_flags.append(f"--timestamp={source_date_epoch()}")  # layer file times
        else:  # podman --read-only mounts a tmpfs on /tmp by itself
            engine.tmp_flags = ["--tmpfs", "/tmp:exec"]
        return engine

    def build(self, file: str, tag: str, *args: str, context: str,
              directory: str = ".") -> None:
        """Build ``file`` with ``directory`` (relative to the checkout) as the build
        context; ``context``: the wheelhouse, a named build context."""
        t0 = time.monotonic()
        old = self.image_id(tag)
        logfile = ROOT / "build" / f"image-test-{re.sub(r'[:/]', '_', tag)}.log"
        with logfile.open("w") as f:
            rc = subprocess.run([self.name, "build", *self.build_flags,
                                 f"--build-context=wheelhouse={context}", *args, "-f", file,
                                 "-t", tag, directory], cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "DOCKER_BUILDKIT": "1"}).returncode
        if rc:
            print("\n".join(logfile.read_text().splitlines()[-40:]), file=sys.stderr)
            raise Failed(f"build of {file} failed")
        log(f"built {tag} from {file} in {time.monotonic() - t0:.0f} s ({self.size(tag)})")
        # The image this tag named before, now untagged: remove it (its layers stay cached
        # where the new one shares them) so repeated runs don't fill the disk.
        if old and old != self.image_id(tag):
            sh(self.name, "rmi", old, check=False, capture=True)

    def build_all(self, builds: list[tuple[str, str, list[str]]], context: str,
                  at_once: int = 2) -> None:
        """Every (file, tag, args) of ``builds``, ``at_once`` at a time; a failure is raised
        once all have ended. Two builds side by side take about as long as one, even on 2
        cores: each spends much of its time in one process (pip unpacking torch, the engine
        writing a layer). More gain little: a commit holds the engine's storage lock."""
        with ThreadPoolExecutor(max_workers=at_once) as pool:
            running = [pool.submit(self.build, file, tag, *args, context=context)
                       for file, tag, args in builds]
        for future in running:
            future.result()  # the first failure, in the order given

    def inspect(self, tag: str, fmt: str) -> str:
        return sh(self.name, "image", "inspect", "--format", fmt, tag, capture=True).stdout

    def image_id(self, tag: str) -> str | None:
        out = sh(self.name, "image", "inspect", "--format", "{{.Id}}", tag, capture=True,
                 check=False)
        return out.stdout.strip() if out.returncode == 0 else None

    def size(self, tag: str) -> str:
        return f"{int(self.inspect(tag, '{{.Size}}')) / 1e9:.2f} GB"

    def run(self, *args: str, capture: bool = False, check: bool = True
            ) -> subprocess.CompletedProcess:
        return sh(self.name, "run", "--rm", *self.run_flags, *args, capture=capture,
                  check=check)


def source_date_epoch() -> str:
    """The commit's time: podman stamps every layer file and the image with it."""
    out = subprocess.run(["git", "log", "-1", "--format=%ct"], cwd=ROOT, capture_output=True,
                         text=True)
    return out.stdout.strip() or "0"
