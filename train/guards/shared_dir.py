"""Does every node of a job see one run directory? The answer decides how checkpoints
are sealed, or stops the job.

Checkpoints are written by every rank into the run directory and sealed by rank 0 (its
``checksums.json`` lists every rank's files, a background save waits for every rank's
marker there), and a resume has every rank read the folder rank 0 chose. That holds
only when the directory is shared (a parallel file system, NFS, a ReadWriteMany
volume). On a node-local directory (``/tmp`` on a SLURM node, an ``emptyDir`` in a pod)
each node holds only its own ranks' part of each checkpoint, a background save would wait
for markers it can never see, and a resume would fail or start over. So at every start
of a multi-node job, rank 0 writes a file with a fresh name there and each node's first
rank looks for it:

- every node sees it: one shared directory, the protocol above;
- some node does not, without ``checkpoint.remote``: the job stops before step 1, on
  every rank alike (exit 3), naming the nodes;
- some node does not, with ``checkpoint.remote``: node-local mode. Each node seals its
  own part locally and uploads it, rank 0 seals the checkpoint in the store once every
  node's part is there, and a resume fetches from the store what a node lacks
  (:mod:`train.checkpoint.uploader`, docs/object-storage.md).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import uuid
from pathlib import Path

from train.core.errors import CannotRunHere
from train.core.run.identity import WorkerIdentity
from train.distributed import ranks

log = logging.getLogger("train")

FIX = ("put output.dir on storage every node mounts (a shared file system; on Kubernetes a "
       "ReadWriteMany volume), or set checkpoint.remote (each node then uploads its own "
       "part of every checkpoint to the store), or run one node per job")


def prepare(run_dir: Path, env: WorkerIdentity, remote: bool = False) -> list[int] | None:
    """Collective: the run directory made by rank 0 (and each node's first rank) and, on
    several nodes, checked to be one directory for all of them. None when it is (or one
    node); else, with ``remote``, each rank's node index in rank order (node-local mode)."""
    if env.is_main or env.local_rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    if env.world_size <= env.local_world_size:  # one node
        ranks.barrier(env)()
        return None
    name = f".shared-{uuid.uuid4().hex[:12]}" if env.is_main else None
    if env.is_main:  # a name never looked up before: no cached answer on any node
        (run_dir / name).touch()
    probe = run_dir / ranks.from_main(name, env)  # in this node's own run directory
    sees = probe.exists() if env.local_rank == 0 else True
    node = env.group_rank if env.group_rank is not None else env.rank // env.local_world_size
    seen = ranks.gather(env)((sees, node, f"node {node} ({socket.gethostname()})"))
    if env.is_main:
        with contextlib.suppress(OSError):
            probe.unlink()
    blind = sorted({where for ok, _, where in seen if not ok})
    if blind and remote:
        if env.is_main:
            log.info("the run directory is node-local (%s %s none of rank 0's files): each "
                     "node uploads its own part of every checkpoint to checkpoint.remote",
                     ", ".join(blind), "sees" if len(blind) == 1 else "see")
        return [n for _, n, _ in seen]
    if blind:
        raise CannotRunHere(f"the run directory {run_dir} is not shared by the job's nodes: "
                            f"{', '.join(blind)} {'sees' if len(blind) == 1 else 'see'} none "
                            f"of the files rank 0 writes there (a node-local disk); {FIX}")
    return None
