"""A job of several nodes writes one run directory: each node must see the same one.

Checkpoints are written by every rank into the run directory and sealed by rank 0 (its
``checksums.json`` lists every rank's files, a background save waits for every rank's
marker there), and a resume has every rank read the folder rank 0 chose. That holds
only when the directory is shared (a parallel file system, NFS, a ReadWriteMany
volume). A node-local directory (``/tmp`` on a SLURM node, an ``emptyDir`` in a pod) on
a job of several nodes would leave each node with part of each checkpoint, a background
save waiting for markers it can never see, and resumes that fail or start over. So at
every start of a multi-node job, rank 0 writes a file with a fresh name there and each
node's first rank looks for it: a node that does not see it stops the job before step 1,
on every rank alike (exit 3), naming the nodes.
"""

from __future__ import annotations

import contextlib
import socket
import uuid
from pathlib import Path

from train.core.errors import CannotRunHere
from train.core.identity import WorkerIdentity
from train.distributed import ranks

FIX = ("put output.dir on storage every node mounts (a shared file system; on Kubernetes a "
       "ReadWriteMany volume), or run one node per job (with checkpoint.remote a replaced "
       "node still resumes from the store)")


def prepare(run_dir: Path, env: WorkerIdentity) -> None:
    """Collective: the run directory made by rank 0 and, on several nodes, checked to be
    one directory for all of them."""
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    if env.world_size <= env.local_world_size:  # one node
        ranks.barrier(env)()
        return
    name = f".shared-{uuid.uuid4().hex[:12]}" if env.is_main else None
    if env.is_main:  # a name never looked up before: no cached answer on any node
        (run_dir / name).touch()
    probe = run_dir / ranks.from_main(name, env)  # in this node's own run directory
    sees = probe.exists() if env.local_rank == 0 else True
    node = env.group_rank if env.group_rank is not None else env.rank // env.local_world_size
    seen = ranks.gather(env)((sees, f"node {node} ({socket.gethostname()})"))
    if env.is_main:
        with contextlib.suppress(OSError):
            probe.unlink()
    blind = sorted({where for ok, where in seen if not ok})
    if blind:
        raise CannotRunHere(f"the run directory {run_dir} is not shared by the job's nodes: "
                            f"{', '.join(blind)} {'sees' if len(blind) == 1 else 'see'} none "
                            f"of the files rank 0 writes there (a node-local disk); {FIX}")
