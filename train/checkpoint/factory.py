"""The run's checkpointer, built once with everything it works with.

Where its files go (the run directory), how the ranks agree (barrier and gather over the
process group), which ranks' files the run directory holds (every rank's, or in
node-local mode this node's: ``nodes``, from :func:`train.guards.shared_dir.prepare`) and
the remote tier on the rank that uploads (:mod:`.tier`) are all decided here, from the
config and the worker's identity, and passed to the :class:`~.store.Checkpointer`'s
constructor: nothing is set on it afterwards. The hang watchdog is handed to each save
(:meth:`~.store.Checkpointer.save`), the one collaborator made later than the
checkpointer.
"""

from __future__ import annotations

from train.checkpoint.listing import Nodes
from train.checkpoint.store import Checkpointer
from train.checkpoint.tier import RemoteTier, tier_for
from train.core.config import Config
from train.core.run.identity import WorkerIdentity
from train.distributed import ranks


def build_checkpointer(cfg: Config, env: WorkerIdentity,
                       nodes: list[int] | None = None) -> Checkpointer:
    """The checkpointer of this rank. ``nodes``: each rank's node index, in rank order,
    when the run directories are node-local (None: one directory every rank shares)."""
    here = list(range(env.world_size)) if nodes is None else \
        [r for r, n in enumerate(nodes) if n == nodes[env.rank]]
    return Checkpointer(cfg.run_dir, rank=env.rank, keep_last=cfg.checkpoint.keep_last,
                        world_size=env.world_size, barrier=ranks.barrier(env),
                        gather=ranks.gather(env), async_timeout_s=cfg.distributed.timeout_s,
                        here=here, tier=_tier(cfg, env, nodes, here),
                        leftovers_age_s=shared_leftovers_age_s(cfg))


def shared_leftovers_age_s(cfg: Config) -> float:
    """With replica groups the checkpoints folder is shared by groups that come and go
    while another writes: a partial checkpoint is a leftover only once unchanged for
    longer than a live writer pauses (its all-reduce and hang limits), 0 otherwise."""
    if cfg.distributed.fault_tolerance != "replicas":
        return 0.0
    return 2 * max(cfg.distributed.replica_timeout_s, cfg.distributed.timeout_s)


def _tier(cfg: Config, env: WorkerIdentity, nodes: list[int] | None,
          here: list[int]) -> RemoteTier | None:
    """The remote tier of the rank that uploads what it seals: rank 0 (a shared run
    directory), or each node's first rank, which uploads its node's part (rank 0's seals
    the checkpoint in the store once every part is there); None on the others."""
    if nodes is None:
        if not env.is_main:
            return None
        return tier_for(cfg.checkpoint.remote, cfg.run_dir, cfg.run.name,
                        cfg.checkpoint.keep_last)
    if env.rank != here[0]:
        return None
    placed = Nodes(nodes[env.rank], tuple(dict.fromkeys(nodes)), cfg.distributed.timeout_s)
    return tier_for(cfg.checkpoint.remote, cfg.run_dir, cfg.run.name, cfg.checkpoint.keep_last,
                    placed)
