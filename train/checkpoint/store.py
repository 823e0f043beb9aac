"""Crash-safe checkpoints: ``checkpoints/step-N/`` plus a ``latest`` pointer.

Protocol (docs/architecture.md, "Checkpoints"): every file is written into
``step-N.partial``, durably (fsync'ed) and hashed while it is written; rank 0 lists
every rank's files with their SHA-256 in ``checksums.json``, renames the folder to
``step-N`` and replaces ``latest`` (a small text file naming it) by rename. A process
killed at any point leaves either the previous checkpoint or the new one, never a torn
one; readers (:mod:`.reader`) verify the checksums and fall back to older ones.

One write path: each rank writes its own files and reports their hashes, rank 0 seals.
A foreground save agrees through collectives (a write that fails on any rank fails on
every rank alike, with that rank's words: no rank is left waiting for another); a
background save, whose thread may not use the training thread's process group, through
a marker file per rank in the partial folder. Nothing else differs. The bytes go
through a :class:`~train.core.storage.local.LocalStorage` (the storage seam,
:mod:`train.core.storage.seam`); keeping the last few and moving stale trajectories
aside is :mod:`.retention`'s.

Node-local run directories (``checkpoint.remote`` on nodes that do not share one,
:mod:`train.guards.shared_dir`): each node's first rank seals that node's part (its
``checksums.json`` lists its own ranks' files, a background save waits only for their
markers) and hands it to its remote tier; the checkpoint as a whole is sealed in the
store (:mod:`.uploader`). Every save of the job carries one token, rank 0's, exchanged in
the save's first collective, so that the parts of one save are never mixed with another's.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from train.checkpoint import reader, retention
from train.checkpoint.serializer import CheckpointWriteError, save_object, snapshot, writing
from train.core.run import rundir
from train.core.run.rundir import CHECKPOINTS, CHECKSUMS, LATEST, NODE_PART, SHARDS, STATE_FILE

if TYPE_CHECKING:
    from train.checkpoint.tier import RemoteTier
    from train.guards.watchdog import Watchdog
from train.core.storage.local import LocalStorage

# Shards: a collective writer of sharded state into a folder, returning the files this
# rank wrote with their SHA-256, hashed while written (in the background: a function that
# waits for the writes and returns them).
Shards = Callable[[Path], Any]


@dataclass
class _Save:
    step: int
    files: dict[str, Any]                   # name in the folder -> what torch.save writes
    shards: Shards | None = None
    token: str = ""                         # rank 0's, the same on every rank
    partial: str = field(init=False)        # names relative to the run directory
    final: str = field(init=False)

    def __post_init__(self):
        self.final = f"{CHECKPOINTS}/{rundir.step_name(self.step)}"
        self.partial = f"{self.final}.partial"


class _Unwatched:
    """A background writer's watch when no watchdog is attached (tools, tests)."""

    def progress(self) -> None:
        pass

    def waits_for(self, what: str) -> None:
        pass


@contextmanager
def _unwatched(step: int) -> Iterator[_Unwatched]:
    yield _Unwatched()


def _nothing() -> None:
    pass


class Checkpointer:
    """Writes the checkpoints of one run and finds them; ``gather`` exchanges a value
    with every rank (alone: a list of one). Built once with its collaborators
    (:func:`~.factory.build_checkpointer` for a run), nothing set afterwards:

    - ``here``: the ranks whose files this run directory holds: every rank's (None, a
      shared directory), or in node-local mode this node's;
    - ``tier``: the remote tier (:mod:`.tier`) on the rank that uploads what it seals
      (rank 0, or in node-local mode each node's first), for a resume to consult too;
      None without ``checkpoint.remote`` and on every other rank.
    """

    def __init__(self, run_dir: Path, *, rank: int, keep_last: int, world_size: int = 1,
                 barrier: Callable[[], None] = lambda: None,
                 gather: Callable[[object], list] = lambda value: [value],
                 async_timeout_s: float = 600, here: list[int] | None = None,
                 tier: RemoteTier | None = None, leftovers_age_s: float = 0.0):
        self.storage = LocalStorage(run_dir)
        self.dir = self.storage.path(CHECKPOINTS)
        self.rank, self.keep_last, self.barrier, self.gather = rank, keep_last, barrier, gather
        self.world_size, self.async_timeout_s = world_size, async_timeout_s
        self.here = here if here is not None else list(range(world_size))
        self.tier = tier
        # replica groups share the folder: what another live group writes is not a leftover
        self.leftovers_age_s = leftovers_age_s
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None

    @property
    def is_node_local(self) -> bool:
        return len(self.here) < self.world_size

    @property
    def seals(self) -> bool:
        """This rank seals what the run directory holds: rank 0, or each node's first."""
        return self.rank == self.here[0]

    def save(self, step: int, shared_state: dict[str, Any], rank_state: dict[str, Any],
             *, background: bool = False, shards: Shards | None = None,
             watchdog: Watchdog | None = None) -> Path:
        """Collective: every rank calls it; rank 0 writes ``shared_state`` (state.pt),
        each rank its own ``rank_state`` and shards. ``background=True`` returns once the
        state is copied (the next save, or :meth:`wait`, joins the writer). ``watchdog``:
        the training thread's hang watchdog (train.guards.watchdog), told after each round
        and file written, so a checkpoint is watched part by part, and watching a
        background save's writer thread on its own."""
        progress = watchdog.progress if watchdog is not None else _nothing
        files = {rundir.rank_file(self.rank): rank_state}
        if self.rank == 0:
            files[STATE_FILE] = shared_state
        save = _Save(step, files, shards)
        save.token = self._together(lambda: self._prepare(save), save.partial, progress)[0]
        folder = self.storage.path(f"{save.partial}/{SHARDS}")
        if background:
            pending = shards(folder) if shards is not None else None  # DCP stages now
            save.files = {name: snapshot(state) for name, state in files.items()}
            watch = watchdog.watching_writer if watchdog is not None else _unwatched
            self._writer = threading.Thread(target=self._in_background,
                                            args=(save, pending, watch),
                                            name=f"checkpoint-step-{step}")
            self._writer.start()
        else:
            shard_files = (lambda: shards(folder)) if shards is not None else None
            hashes = self._together(lambda: self._write(save, shard_files, progress),
                                    save.partial, progress)
            self._together(lambda: self._seal(save, hashes) if self.seals else None,
                           save.partial, progress)
        return self.storage.path(save.final)

    def wait(self) -> None:
        """Join a background save, and the deletion of pruned checkpoints; a save's
        failure is raised here, in the training thread."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        retention.settle(self.storage)
        if self._writer_error is not None:
            error, self._writer_error = self._writer_error, None
            if isinstance(error, CheckpointWriteError):
                raise error
            raise RuntimeError(f"background checkpoint failed: {error}") from error

    def _together(self, action: Callable[[], Any], partial: str,
                  progress: Callable[[], None]) -> list:
        """This rank's part, then every rank's results: the first failure to write
        anywhere is raised everywhere, and the sealer removes ``partial`` then. The rank
        that failed removed it already, but another rank may have been writing into it
        (recreating it) at that moment; after the exchange no rank writes. Collective."""
        error, result = None, None
        try:
            result = action()
        except CheckpointWriteError as exc:
            error = str(exc)
        progress()
        exchanged = self.gather((error, result))
        progress()
        failed = [e for e, _ in exchanged if e]
        if failed:
            if self.seals:
                self.storage.delete(partial)
            raise CheckpointWriteError(failed[0])
        return [r for _, r in exchanged]

    def _prepare(self, save: _Save) -> str | None:
        """A background save still in flight ends first (its failure fails this save);
        the sealer clears what a failed write of this step may have left. Rank 0's
        answer: the save's token."""
        self.wait()
        if self.seals:
            self.storage.delete(save.partial)
        return uuid.uuid4().hex if self.rank == 0 else None

    def _write(self, save: _Save, shard_files: Callable[[], dict[Path, str]] | None,
               progress: Callable[[], None] = lambda: None) -> dict[str, str]:
        """This rank's shards (``shard_files`` writes them, or waits for their writes)
        and files, each hashed: name in the folder -> SHA-256."""
        hashes = {}
        if shard_files is not None:
            with writing(self.storage, save.partial, f"{save.partial}/{SHARDS}"):
                top = self.storage.path(save.partial)
                for path, digest in shard_files().items():
                    hashes[path.relative_to(top).as_posix()] = digest
            progress()
        for name, state in save.files.items():
            with writing(self.storage, save.partial, f"{save.partial}/{name}"):
                hashes[name] = save_object(self.storage, f"{save.partial}/{name}", state)
            progress()
        return hashes

    def _in_background(self, save: _Save, pending: Callable[[], dict[Path, str]] | None,
                       watch_writer: Callable[[int], Any]) -> None:
        try:
            with watch_writer(save.step) as watch:
                mine = self._write(save, pending, watch.progress)
                marker = f"{save.partial}/rank-{self.rank}.done"
                with writing(self.storage, save.partial, marker):
                    self.storage.replace(marker, json.dumps(mine).encode())
                if self.seals:
                    self._seal(save, _markers(self.storage, save, self.here,
                                              self.async_timeout_s, watch))
        except BaseException as exc:  # surfaced by wait(), in the training thread: any
            # failure here (a KeyboardInterrupt too) must fail the save there, and a thread
            # has nowhere else to raise it
            self._writer_error = exc

    def _seal(self, save: _Save, hashes: list[dict[str, str]]) -> None:
        """checksums.json (the files of every rank here) makes the folder complete; it is
        renamed into place and ``latest`` names it. The same step saved again (after a
        resume): the old copy stays loadable until the new one is in place and named.
        ``hashes``: every rank's (a foreground save), or those here (a background one)."""
        whole = _merged(hashes) if len(hashes) == self.world_size else None
        if len(hashes) > len(self.here):
            hashes = [hashes[r] for r in self.here]
        sums = _merged(hashes)
        with writing(self.storage, save.partial, f"{save.partial}/{CHECKSUMS}"):
            self.storage.replace(f"{save.partial}/{CHECKSUMS}",
                                 (json.dumps(sums, indent=1) + "\n").encode())
            if self.is_node_local:  # never resumed alone: the store holds the whole one
                self.storage.replace(f"{save.partial}/{NODE_PART}", b"")
            replaced = f"{save.final}.replaced"
            if self.storage.exists(save.final):
                self.storage.delete(replaced)
                self.storage.move(save.final, replaced)
            self.storage.move(save.partial, save.final)
            self.storage.replace(f"{CHECKPOINTS}/{LATEST}",
                                 f"{rundir.step_name(save.step)}\n".encode())
            self.storage.delete(replaced)
        retention.prune(self.storage, self.keep_last, self.leftovers_age_s)
        if self.tier is None:
            return
        if self.is_node_local:
            self.tier.uploader.sealed(save.step, token=save.token, whole=whole)
        else:
            self.tier.uploader.sealed(save.step)

    # ------------------------------------------------------------- finding them
    def latest_name(self) -> str | None:
        return rundir.latest_name(self.dir)

    def latest_step(self) -> int | None:
        name = self.latest_name()
        return rundir.step_of(Path(name)) if name else None

    def newest_loadable(self, rank: int = 0) -> tuple[Path, dict, dict | None] | None:
        return reader.newest_loadable(self.dir, rank)

    verify = staticmethod(reader.verify)
    load = staticmethod(reader.load)


def _markers(storage: LocalStorage, save: _Save, here: list[int], timeout_s: float,
             watch) -> list[dict[str, str]]:
    """The hashes of every rank whose files are here, once each has written its
    marker (the sealer only); the watch is told which ranks it waits for, and of each
    marker that appears."""
    watch = watch or _Unwatched()
    names = [f"{save.partial}/rank-{r}.done" for r in here]
    deadline = time.monotonic() + timeout_s
    seen = 0
    while not all(storage.exists(n) for n in names):
        missing = [r for r, n in zip(here, names, strict=True) if not storage.exists(n)]
        if len(names) - len(missing) > seen:
            seen = len(names) - len(missing)
            watch.progress()
        watch.waits_for(f"rank{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(str, missing))} to write {save.partial}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks did not finish writing {save.partial} in time")
        if not storage.exists(save.partial):  # a rank's write failed: it went
            raise RuntimeError(f"{save.partial} was removed by a rank whose write failed")
        time.sleep(0.05)
    hashes = [json.loads(storage.read_text(n)) for n in names]
    for name in names:
        storage.delete(name)
    return hashes


def _merged(hashes: list[dict[str, str]]) -> dict[str, str]:
    return dict(sorted((name, digest) for part in hashes for name, digest in part.items()))
