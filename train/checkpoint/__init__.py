"""Checkpoints of a run: the file protocol (:mod:`.store`), what each rank writes
(:mod:`.serializer`, and :mod:`.sharded` for DCP shards), what a checkpoint holds
(:mod:`.state`), the decisions around it (:mod:`.policy`: when to save, which
checkpoint a start resumes) and the trainer's save and resume (:mod:`.session`).

How the launcher reads the layout before any worker starts is :mod:`train.core.rundir`'s.
"""

from train.checkpoint.store import (
                                    Checkpointer,
                                    CheckpointsUnusable,
                                    CheckpointWriteError,
                                    save_file,
                                    write_error,
)

__all__ = ["CheckpointWriteError", "Checkpointer", "CheckpointsUnusable", "save_file",
           "write_error"]
