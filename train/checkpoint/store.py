"""Crash-safe checkpoints: ``checkpoints/step-N/`` plus a ``latest`` pointer.

Protocol (docs/architecture.md, "Checkpoints"): every file is written into ``step-N.partial``,
fsync'ed and listed with its SHA-256 in ``checksums.json``; then the directory is
renamed to ``step-N`` and ``latest`` (a small text file naming it) is replaced by
rename. A process killed at any point leaves either the previous checkpoint or the
new one, never a torn one. Loading verifies the checksums and falls back to older
checkpoints with a warning. Files load with ``torch.load(weights_only=True)``.

The checkpointer is handed the state; it never reaches into the trainer. What the
state holds is :mod:`train.checkpoint.state`'s business.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from train.checkpoint.serializer import (
    CheckpointWriteError,
    save_file,
    snapshot,
    write_error,
)
from train.checkpoint.sharded import SHARDS_DIR
from train.core import rundir
from train.core.files import describe_load_error as load_error
from train.core.files import fsync_dir, sha256_file, write_atomic
from train.core.rundir import CHECKSUMS, STATE_FILE, none_usable, step_of

log = logging.getLogger("train")

class Checkpointer:
    """Writes and finds checkpoints of one run; ``barrier`` syncs ranks (no-op alone)."""

    def __init__(self, run_dir: Path, *, rank: int, keep_last: int, world_size: int = 1,
                 barrier: Callable[[], None] = lambda: None,
                 gather: Callable[[object], list] = lambda value: [value],
                 async_timeout_s: float = 600):
        self.dir = run_dir / rundir.CHECKPOINTS
        self.rank, self.keep_last, self.barrier, self.gather = rank, keep_last, barrier, gather
        self.world_size, self.async_timeout_s = world_size, async_timeout_s
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None

    # ---------------------------------------------------------------- saving
    def save(self, step: int, shared_state: dict[str, Any], rank_state: dict[str, Any],
             *, background: bool = False,
             shards: Callable[[Path], list[Path]] | None = None) -> Path:
        """Collective: every rank calls it. Rank 0 writes shared_state; each rank its own.

        background=True returns once the state is copied; files are written, sealed and
        `latest` updated by a thread (the next save or :meth:`wait` joins it). A write
        that fails on any rank fails on every rank alike, with that rank's words
        (:class:`CheckpointWriteError`): no rank is left waiting for another.
        shards: a collective writer of sharded state (:mod:`.sharded`) into a folder of
        the checkpoint, returning the files this rank wrote (background: a function that
        waits for its writes and returns them): each rank hashes its own, rank 0 lists
        them all.
        """
        final = self.dir / rundir.step_name(step)
        partial = final.with_name(final.name + ".partial")
        mine = partial / rundir.rank_file(self.rank)
        main = self.rank == 0
        hashed: dict[str, str] = {}

        def write() -> None:
            save_file(rank_state, mine)
            if main:
                save_file(shared_state, partial / STATE_FILE)

        def write_shards() -> None:
            folder = partial / SHARDS_DIR
            for path in shards(folder):
                hashed[str(path.relative_to(partial))] = sha256_file(path)

        def seal() -> None:
            self._seal(partial, final, known)
            self._prune()

        self._together(partial, partial, self.wait, wrap=False)  # a background save failed
        self._together(partial, partial, (lambda: self._fresh(partial)) if main else None)
        if background:
            pending = shards(partial / SHARDS_DIR) if shards is not None else None
            args = (partial, final, snapshot(shared_state) if main else None,
                    snapshot(rank_state), pending)
            self._writer = threading.Thread(target=self._write_in_background, args=args,
                                            name=f"checkpoint-step-{step}")
            self._writer.start()
            return final
        self._together(partial, partial / STATE_FILE if main else mine, write)
        known: dict[str, str] = {}
        if shards is not None:  # every rank writes its shards, then hashes them
            self._together(partial, partial / SHARDS_DIR, write_shards)
            for part in self.gather(hashed):
                known.update(part)
        self._together(partial, partial / CHECKSUMS, seal if main else None)
        return final

    @staticmethod
    def _fresh(partial: Path) -> None:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    def _together(self, partial: Path, path: Path, action: Callable[[], object] | None,
                  wrap: bool = True) -> None:
        """Run this rank's part (if any), then agree with every rank: the first failure
        to write anywhere is raised everywhere. Collective. wrap: count any OSError of
        the action as a failure to write ``path``."""
        error = None
        try:
            if action is not None:
                with self._writing(partial, path) if wrap else contextlib.nullcontext():
                    action()
        except CheckpointWriteError as exc:
            error = str(exc)
        failed = [e for e in self.gather(error) if e]
        if failed:
            raise CheckpointWriteError(failed[0])

    @contextlib.contextmanager
    def _writing(self, partial: Path, path: Path):
        """A failed write is one CheckpointWriteError; the partial checkpoint goes with it
        (left behind, it would keep a full disk full)."""
        try:
            yield
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, CheckpointWriteError):
                raise
            needed = self._latest_size()
            shutil.rmtree(partial, ignore_errors=True)
            raise write_error(exc, path, needed, self.dir) from exc

    def _latest_size(self) -> int | None:
        name = self.latest_name()
        if not name:
            return None
        try:
            return sum(f.stat().st_size for f in (self.dir / name).iterdir() if f.is_file())
        except OSError:
            return None

    def wait(self) -> None:
        """Join a background save; its failure is raised here, in the training thread."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._writer_error is not None:
            error, self._writer_error = self._writer_error, None
            if isinstance(error, CheckpointWriteError):
                raise error
            raise RuntimeError(f"background checkpoint failed: {error}") from error

    def _write_in_background(self, partial: Path, final: Path, shared: Any, mine: Any,
                             pending: Callable[[], list[Path]] | None) -> None:
        """pending: the shard writes in flight, when sharded. Each rank's marker holds the
        hashes of its shards."""
        try:
            with self._writing(partial, partial / rundir.rank_file(self.rank)):
                save_file(mine, partial / rundir.rank_file(self.rank))
            hashed = {}
            if pending is not None:
                with self._writing(partial, partial / SHARDS_DIR):
                    hashed = {str(p.relative_to(partial)): sha256_file(p) for p in pending()}
            with self._writing(partial, partial / f"rank-{self.rank}.done"):
                write_atomic(partial / f"rank-{self.rank}.done", json.dumps(hashed))
            if self.rank != 0:
                return
            with self._writing(partial, partial / STATE_FILE):
                save_file(shared, partial / STATE_FILE)
            # Ranks have no collective here (the training thread owns the process group):
            # rank 0 seals once every rank's marker is on the shared run directory.
            markers = [partial / f"rank-{r}.done" for r in range(self.world_size)]
            deadline = time.monotonic() + self.async_timeout_s
            while not all(m.exists() for m in markers):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish writing {partial} in time")
                if not partial.is_dir():  # another rank's write failed and removed it
                    raise RuntimeError(f"{partial} was removed by a rank whose write failed")
                time.sleep(0.05)
            known: dict[str, str] = {}
            for m in markers:
                known.update(json.loads(m.read_text()))
                m.unlink()
            with self._writing(partial, partial / CHECKSUMS):
                self._seal(partial, final, known)
            self._prune()
        except BaseException as exc:  # surfaced by wait()
            self._writer_error = exc

    def _seal(self, partial: Path, final: Path, known: dict[str, str] | None = None) -> None:
        """known: hashes other ranks computed of their own files (relative names)."""
        sums = {p.name: sha256_file(p) for p in sorted(partial.iterdir()) if p.is_file()}
        sums.update(known or {})
        write_atomic(partial / CHECKSUMS, json.dumps(sums, indent=1) + "\n")
        fsync_dir(partial)
        # The same step saved again (after a resume): the old copy stays loadable until
        # the new one is in place and named by `latest`.
        replaced = final.with_name(final.name + ".replaced")
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(partial, final)
        write_atomic(self.dir / rundir.LATEST, final.name + "\n")
        fsync_dir(self.dir)
        shutil.rmtree(replaced, ignore_errors=True)

    def set_aside(self) -> Path | None:
        """Starting a run over: move its old checkpoints out of the way (not deleted), so
        a later resume can never pick up a checkpoint of the previous attempt."""
        if not self.dir.is_dir() or not any(self.dir.iterdir()):
            return None
        target = self._aside("replaced")
        os.replace(self.dir, target)
        return target

    def latest_name(self) -> str | None:
        return rundir.latest_name(self.dir)

    def latest_step(self) -> int | None:
        name = self.latest_name()
        return step_of(Path(name)) if name else None

    def _prune(self) -> None:
        """Keep the newest keep_last checkpoints up to `latest` (always including it).
        Step directories newer than `latest` belong to an abandoned trajectory (a resume
        from an older checkpoint, or past one that did not verify): they are moved aside
        to checkpoints.abandoned-<time>/, never deleted, and never resumed by accident."""
        newest = self.latest_step()
        if newest is not None:
            self.set_aside_newer_than(newest)
        steps = sorted(self._step_dirs(), key=step_of, reverse=True)
        for old in steps[self.keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
        self.remove_leftovers()

    def remove_leftovers(self) -> None:
        """Partial checkpoints of a write that died (kill -9, a full disk) and copies
        replaced by a re-save: never loadable, and they hold disk space. Only while no
        save is in flight (after one, or before the first: one writer per run)."""
        for stale in self.dir.glob("step-*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        for old in self.dir.glob("step-*.replaced"):
            final = old.with_name(old.name.removesuffix(".replaced"))
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:  # killed between the renames of _seal: the old copy is the checkpoint
                os.replace(old, final)

    def set_aside_newer_than(self, step: int) -> Path | None:
        """Resuming from ``step`` while newer checkpoints exist (an explicit resume_from, or
        newer ones that did not verify): move those to checkpoints.abandoned-<time>/, whole,
        so that nothing is deleted or overwritten and no later resume picks them up."""
        newer = sorted((p for p in self._step_dirs() if step_of(p) > step), key=step_of)
        if not newer:
            return None
        target = self._aside("abandoned")
        target.mkdir(parents=True)
        for path in newer:
            os.replace(path, target / path.name)
        log.warning("moved %s (newer than step-%d, which this run continues from) to %s",
                    ", ".join(p.name for p in newer), step, target)
        return target

    def _aside(self, why: str) -> Path:
        """A new folder name beside checkpoints/ for directories moved out of the way."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        target = self.dir.with_name(f"checkpoints.{why}-{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = self.dir.with_name(f"checkpoints.{why}-{stamp}-{n}")
        return target

    # --------------------------------------------------------------- loading
    def _step_dirs(self) -> list[Path]:
        return rundir.step_dirs(self.dir)

    def candidates(self) -> list[Path]:
        """Newest first: the one `latest` names, then every step-N by step."""
        return rundir.candidates(self.dir)

    @staticmethod
    def verify(path: Path) -> str | None:
        """None when every file matches checksums.json, else what is wrong."""
        problem = rundir.quick_check(path)
        if problem:
            return problem
        sums = json.loads((path / CHECKSUMS).read_text())
        for name, digest in sums.items():
            if sha256_file(path / name) != digest:
                return f"{name} does not match its checksum"
        return None

    @staticmethod
    def load(path: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        import torch
        shared = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        own = path / rundir.rank_file(rank)
        mine = torch.load(own, map_location="cpu", weights_only=True) if own.exists() else None
        return shared, mine

    def newest_loadable(self, rank: int = 0) -> tuple[Path, dict, dict | None] | None:
        """The newest checkpoint that verifies and loads, loaded; a warning for each one
        passed over. None when there are no checkpoints; CheckpointsUnusable when there
        are some but none verifies and loads (never a silent start from step 0)."""
        found, problems = self.candidates(), []
        for path in found:
            problem = self.verify(path)
            if problem is None:
                try:
                    return (path, *self.load(path, rank))
                except Exception as exc:  # verified bytes that torch cannot read back
                    problem = f"cannot be loaded: {load_error(exc)}"
            log.warning("checkpoint %s is unusable (%s); trying the previous one", path, problem)
            problems.append((path.name, problem))
        if found:
            raise CheckpointsUnusable(none_usable(self.dir, problems))
        return None


class CheckpointsUnusable(Exception):
    """Checkpoints exist and none of them can be resumed."""
