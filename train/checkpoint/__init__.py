"""Checkpoints of a run: the file protocol (:mod:`.store`: write, hash, seal), built once
with its collaborators (:mod:`.factory`), what each rank writes (:mod:`.serializer`) in
which format (:mod:`.formats`: full, or sharded with :mod:`.sharded`), what a checkpoint
holds (:mod:`.state`), finding and loading one (:mod:`.reader`), which to keep
(:mod:`.retention`), the remote tier (:mod:`.tier`: what the store holds,
:mod:`.listing`; the upload of each sealed checkpoint, :mod:`.uploader`; the fetch of a
remote one, :mod:`.fetcher`; and a finished run's last one, :mod:`.left_behind`), every
checkpoint a start may resume from (:mod:`.catalog`), the decisions around them
(:mod:`.policy`: when to save, which checkpoint a start resumes) and the trainer's save
and resume (:mod:`.session`).

Where the bytes live (a folder, a bucket) is the storage room's,
:mod:`train.core.storage`.

How the launcher reads the layout before any worker starts is :mod:`train.core.run.rundir`'s.
"""

from train.checkpoint.reader import CheckpointsUnusable
from train.checkpoint.serializer import CheckpointWriteError, save_file, write_error
from train.checkpoint.store import Checkpointer

__all__ = ["CheckpointWriteError", "Checkpointer", "CheckpointsUnusable", "save_file",
           "write_error"]
