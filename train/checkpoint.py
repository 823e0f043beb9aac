"""Crash-safe checkpoints: ``checkpoints/step-N/`` plus a ``latest`` pointer.

Protocol (docs/architecture.md, "Checkpoints"): every file is written into ``step-N.partial``,
fsync'ed and listed with its SHA-256 in ``checksums.json``; then the directory is
renamed to ``step-N`` and ``latest`` (a small text file naming it) is replaced by
rename. A process killed at any point leaves either the previous checkpoint or the
new one, never a torn one. Loading verifies the checksums and falls back to older
checkpoints with a warning. Files load with ``torch.load(weights_only=True)``.

The checkpointer is handed the state; it never reaches into the trainer. What the
state holds is :mod:`train.state`'s business.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from train.files import fsync_dir, fsync_file, sha256_file, write_atomic

log = logging.getLogger("train")

STATE_FILE = "state.pt"
CHECKSUMS = "checksums.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _step_of(path: Path) -> int:
    return int(path.name.split("-")[1])


def save_file(obj: Any, path: Path) -> None:
    torch.save(obj, path)
    fsync_file(path)


def snapshot(state: Any) -> Any:
    """A CPU copy that training can no longer mutate (for writing in the background)."""
    return tree_map(lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor)
                    else t, state)


class Checkpointer:
    """Writes and finds checkpoints of one run; ``barrier`` syncs ranks (no-op alone)."""

    def __init__(self, run_dir: Path, *, rank: int, keep_last: int, world_size: int = 1,
                 barrier: Callable[[], None] = lambda: None, async_timeout_s: float = 600):
        self.dir = run_dir / "checkpoints"
        self.rank, self.keep_last, self.barrier = rank, keep_last, barrier
        self.world_size, self.async_timeout_s = world_size, async_timeout_s
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None

    # ---------------------------------------------------------------- saving
    def save(self, step: int, shared_state: dict[str, Any], rank_state: dict[str, Any],
             *, background: bool = False) -> Path:
        """Collective: every rank calls it. Rank 0 writes shared_state; each rank its own.

        background=True returns once the state is copied; files are written, sealed and
        `latest` updated by a thread (the next save or :meth:`wait` joins it).
        """
        self.wait()
        partial = self.dir / f"step-{step}.partial"
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        self.barrier()
        final = self.dir / f"step-{step}"
        if background:
            args = (partial, final, snapshot(shared_state) if self.rank == 0 else None,
                    snapshot(rank_state))
            self._writer = threading.Thread(target=self._write_in_background, args=args,
                                            name=f"checkpoint-step-{step}")
            self._writer.start()
            return final
        save_file(rank_state, partial / f"rank-{self.rank}.pt")
        if self.rank == 0:
            save_file(shared_state, partial / STATE_FILE)
        self.barrier()
        if self.rank == 0:
            self._seal(partial, final)
            self._prune()
        self.barrier()
        return final

    def wait(self) -> None:
        """Join a background save; its failure is raised here, in the training thread."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._writer_error is not None:
            error, self._writer_error = self._writer_error, None
            raise RuntimeError(f"background checkpoint failed: {error}") from error

    def _write_in_background(self, partial: Path, final: Path, shared: Any, mine: Any) -> None:
        try:
            save_file(mine, partial / f"rank-{self.rank}.pt")
            (partial / f"rank-{self.rank}.done").touch()
            if self.rank != 0:
                return
            save_file(shared, partial / STATE_FILE)
            # Ranks have no collective here (the training thread owns the process group):
            # rank 0 seals once every rank's marker is on the shared run directory.
            markers = [partial / f"rank-{r}.done" for r in range(self.world_size)]
            deadline = time.monotonic() + self.async_timeout_s
            while not all(m.exists() for m in markers):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish writing {partial} in time")
                time.sleep(0.05)
            for m in markers:
                m.unlink()
            self._seal(partial, final)
            self._prune()
        except BaseException as exc:  # surfaced by wait()
            self._writer_error = exc

    def _seal(self, partial: Path, final: Path) -> None:
        sums = {p.name: sha256_file(p) for p in sorted(partial.iterdir()) if p.is_file()}
        write_atomic(partial / CHECKSUMS, json.dumps(sums, indent=1) + "\n")
        fsync_dir(partial)
        # The same step saved again (after a resume): the old copy stays loadable until
        # the new one is in place and named by `latest`.
        replaced = final.with_name(final.name + ".replaced")
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(partial, final)
        write_atomic(self.dir / "latest", final.name + "\n")
        fsync_dir(self.dir)
        shutil.rmtree(replaced, ignore_errors=True)

    def set_aside(self) -> Path | None:
        """Starting a run over: move its old checkpoints out of the way (not deleted), so
        a later resume can never pick up a checkpoint of the previous attempt."""
        if not self.dir.is_dir() or not any(self.dir.iterdir()):
            return None
        stamp = time.strftime("%Y%m%dT%H%M%S")
        target = self.dir.with_name(f"checkpoints.replaced-{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = self.dir.with_name(f"checkpoints.replaced-{stamp}-{n}")
        os.replace(self.dir, target)
        return target

    def latest_step(self) -> int | None:
        try:
            match = _STEP_DIR.match((self.dir / "latest").read_text().strip())
        except OSError:
            return None
        return int(match.group(1)) if match else None

    def _prune(self) -> None:
        """Keep the newest keep_last checkpoints up to `latest` (always including it);
        step directories newer than `latest` belong to an abandoned trajectory (a resume
        from an older checkpoint) and go."""
        newest = self.latest_step()
        steps = sorted(self._step_dirs(), key=_step_of, reverse=True)
        if newest is not None:
            for abandoned in [p for p in steps if _step_of(p) > newest]:
                shutil.rmtree(abandoned, ignore_errors=True)
            steps = [p for p in steps if _step_of(p) <= newest]
        for old in steps[self.keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in [*self.dir.glob("step-*.partial"), *self.dir.glob("step-*.replaced")]:
            shutil.rmtree(stale, ignore_errors=True)

    # --------------------------------------------------------------- loading
    def _step_dirs(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return [p for p in self.dir.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]

    def candidates(self) -> list[Path]:
        """Newest first: the one `latest` names, then every step-N by step."""
        ordered = sorted(self._step_dirs(), key=_step_of, reverse=True)
        try:
            named = self.dir / (self.dir / "latest").read_text().strip()
            if named in ordered:
                ordered.remove(named)
                ordered.insert(0, named)
        except OSError:
            pass
        return ordered

    @staticmethod
    def verify(path: Path) -> str | None:
        """None when every file matches checksums.json, else what is wrong."""
        try:
            sums = json.loads((path / CHECKSUMS).read_text())
        except (OSError, ValueError):
            return "missing or unreadable checksums.json"
        if STATE_FILE not in sums:
            return f"no {STATE_FILE}"
        for name, digest in sums.items():
            file = path / name
            if not file.is_file() or sha256_file(file) != digest:
                return f"{name} is missing or does not match its checksum"
        return None

    @staticmethod
    def load(path: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        shared = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        own = path / f"rank-{rank}.pt"
        mine = torch.load(own, map_location="cpu", weights_only=True) if own.exists() else None
        return shared, mine

    def newest_valid(self) -> Path | None:
        """The newest checkpoint whose files match their checksums (warning on others)."""
        for path in self.candidates():
            problem = self.verify(path)
            if problem is None:
                return path
            log.warning("checkpoint %s is unusable (%s); trying the previous one", path, problem)
        return None

    def load_newest(self, rank: int) -> tuple[Path, dict, dict | None] | None:
        """Single-process convenience (export, tools): newest valid checkpoint, loaded."""
        path = self.newest_valid()
        return None if path is None else (path, *self.load(path, rank))
