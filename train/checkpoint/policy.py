"""When a run saves, and which checkpoint a start resumes.

Saving: every ``checkpoint.every_steps`` steps, and always at the last step a run
takes (the final step, or the step every rank agreed to stop at after a signal). The
last one is written in the foreground, so exit 0 or 143 means it is on disk; the
others in the background with ``checkpoint.async_save``.

Resuming: rank 0 picks (:func:`choose_checkpoint`) and every rank loads the same one;
what there is to pick from, local and remote, the policy asks one
:class:`~.catalog.Catalog`.
With node-local run directories (a node holds only its own ranks' part of each local
checkpoint) the one to resume comes from the store: rank 0 lists the remote sealed ones
and every node fetches from the chosen one what its ranks read (:func:`_from_the_store`):
the shared state, its ranks' own files and, of a sharded checkpoint, the shard files
its ranks' shards overlap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from train.checkpoint.catalog import Catalog
from train.checkpoint.fetcher import SHARDS_INDEX
from train.checkpoint.store import Checkpointer
from train.core.config import AUTO, Config
from train.core.errors import CannotRunHere, ConfigError
from train.core.run import rundir
from train.core.run.identity import WorkerIdentity
from train.core.storage.s3 import said
from train.distributed import ranks

log = logging.getLogger("train")

# The files of a sharded checkpoint's folder this rank's load reads (sharded.files_read).
Reads = Callable[[Path], set[str]]


@dataclass(frozen=True)
class Cadence:
    """When to save: ``due(step, last)`` -> None (no save), "foreground" or "background"."""
    every_steps: int
    async_save: bool

    @classmethod
    def from_config(cls, cfg: Config) -> Cadence:
        return cls(cfg.checkpoint.every_steps, cfg.checkpoint.async_save)

    def due(self, step: int, last: bool) -> str | None:
        if last:
            return "foreground"
        if self.every_steps and step % self.every_steps == 0:
            return "background" if self.async_save else "foreground"
        return None


def choose_checkpoint(checkpointer: Checkpointer, choice: str, env: WorkerIdentity,
                      source: str, reads: Reads | None = None
                      ) -> tuple[Path | None, tuple | None]:
    """Rank 0 picks the checkpoint (the newest that verifies and loads, with a warning for
    each one passed over) and every rank loads that one: ranks deciding on their own could
    resume from different steps after one of them failed to read a file. Returns the path
    and, on rank 0, what it already loaded. ``reads``: which files of a sharded
    checkpoint this rank loads (node-local mode fetches only those)."""
    if choice == "none" and env.continuing:
        choice = AUTO  # a restart of this attempt continues it instead of starting over
    catalog = Catalog(checkpointer.storage, checkpointer.tier)
    if checkpointer.is_node_local:
        return _from_the_store(checkpointer, catalog, choice, env, source, reads), None
    if choice == "none":
        if env.is_main:
            catalog.set_aside()
        ranks.barrier(env)()
        return None, None
    path, loaded, problem = None, None, None
    if env.is_main:
        # replica groups: another group may be writing, or sealing a newer one, right now
        shared = checkpointer.leftovers_age_s > 0
        catalog.remove_leftovers(checkpointer.leftovers_age_s)
        path, loaded, problem = catalog.pick(choice)
        if path is not None and path.parent == catalog.dir and not (shared and choice == AUTO):
            catalog.set_aside_newer_than(rundir.step_of(path))
    path, problem = ranks.from_main((str(path) if path else None, problem), env)
    if problem:
        raise ConfigError(source, "checkpoint.resume_from", problem)
    return (Path(path) if path else None), loaded


def _from_the_store(checkpointer: Checkpointer, catalog: Catalog, choice: str,
                    env: WorkerIdentity, source: str, reads: Reads | None) -> Path | None:
    """Node-local mode: the newest remote checkpoint that every node fetches and verifies
    (each node's first rank, into its own run directory: what its ranks read), the same
    on every rank; None for a fresh start. Collective."""
    if choice not in (AUTO, "none"):
        raise CannotRunHere(f"checkpoint.resume_from={choice}: a path needs a run directory "
                            "every node sees; with node-local run directories a run resumes "
                            "from checkpoint.remote (auto) or starts over (none)")
    seals = checkpointer.seals
    if seals:
        catalog.remove_leftovers()
    if choice == "none":
        if seals:
            catalog.set_aside()
        ranks.barrier(env)()
        return None
    steps, problem = catalog.remote_steps() if env.is_main else (None, None)
    steps, problem = ranks.from_main((steps, problem), env)
    if problem:
        raise CannotRunHere(problem)
    gather = ranks.gather(env)
    for step in steps:
        problems = _fetch_everywhere(checkpointer, catalog, env, step, reads)
        if not problems:
            if seals:
                log.info("fetched checkpoint step-%d from %s", step, catalog.where)
                catalog.set_aside_newer_than(step)
            ranks.barrier(env)()
            return catalog.folder(step)
        if env.is_main:
            log.warning("remote checkpoint %s/%s/%s is unusable (%s); trying the previous "
                        "one", catalog.where, rundir.CHECKPOINTS, rundir.step_name(step),
                        problems[0])
    held = any(gather(seals and catalog.holds_any()))
    if steps or held:  # never a silent start from step 0
        raise ConfigError(source, "checkpoint.resume_from",
                          "the run directories are node-local (each node holds its part of "
                          "a checkpoint), so a run resumes from checkpoint.remote, and "
                          f"{'no checkpoint there could be fetched' if steps else 'it holds none'}"
                          "; set checkpoint.resume_from=none to start over")
    return None


def _fetch_everywhere(checkpointer: Checkpointer, catalog: Catalog, env: WorkerIdentity,
                      step: int, reads: Reads | None) -> list[str]:
    """Collective: each node's first rank fetches ``step``: first what every rank reads
    (state.pt, its ranks' rank files, a sharded checkpoint's index), then the shard files
    its ranks load, which each rank names from that index (every file when one cannot).
    What went wrong on any node (nothing: fetched everywhere), on every rank."""
    gather, seals = ranks.gather(env), checkpointer.seals
    problems = [p for p in gather(catalog.fetch_part(step, checkpointer.here) if seals
                                  else None) if p]
    if problems:
        if seals:
            catalog.drop_fetch(step)
        return problems
    wanted = gather(_shards_read(catalog.dir / f"{rundir.step_name(step)}.partial", reads))
    mine = [wanted[r] for r in checkpointer.here]
    shards = None if None in mine else set().union(*mine)
    return [p for p in gather(catalog.fetch_rest(step, shards) if seals else None) if p]


def _shards_read(folder: Path, reads: Reads | None) -> set[str] | None:
    """The shard files this rank loads from the checkpoint being fetched into ``folder``
    (nothing more for the full format), or None: every one."""
    index = folder / rundir.SHARDS
    if not (index / SHARDS_INDEX).is_file():
        return set()
    if reads is None:
        return None
    try:
        return {f"{rundir.SHARDS}/{name}" for name in reads(index)}
    except Exception as exc:  # what the load will say too: fetch it all, let it say so.
        # torch.distributed.checkpoint's index is a pickle: reading it raises unrelated
        # types (UnpicklingError, EOFError, RuntimeError, ...), none of them to act on here
        log.info("cannot tell from %s which shard files this rank reads (%s): fetching "
                 "every one", index / SHARDS_INDEX, said(exc))
        return None
