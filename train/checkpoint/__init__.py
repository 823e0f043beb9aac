"""Checkpoints of a run: the file protocol (:mod:`.store`: write, hash, seal), where
the bytes live (:mod:`.storage`: the seam for other storage), what each rank writes
(:mod:`.serializer`) in which format (:mod:`.formats`: full, or sharded with
:mod:`.sharded`), what a checkpoint holds (:mod:`.state`), finding and loading one
(:mod:`.reader`), which to keep (:mod:`.retention`), the decisions around it
(:mod:`.policy`: when to save, which checkpoint a start resumes) and the trainer's save
and resume (:mod:`.session`).

How the launcher reads the layout before any worker starts is :mod:`train.core.run.rundir`'s.
"""

from train.checkpoint.reader import CheckpointsUnusable
from train.checkpoint.serializer import CheckpointWriteError, save_file, write_error
from train.checkpoint.store import Checkpointer

__all__ = ["CheckpointWriteError", "Checkpointer", "CheckpointsUnusable", "save_file",
           "write_error"]
