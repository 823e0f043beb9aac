"""The trainer's checkpoints: what a save gathers (in the run's format: full tensors on
rank 0, or each rank's own shards) and how a start resumes from the checkpoint rank 0
chose.

The file protocol is :mod:`.store`'s, the formats :mod:`.formats`', what a checkpoint
holds :mod:`.state`'s, which one to resume :mod:`.policy`'s.
"""

from __future__ import annotations

import logging
import sys

import torch

from train.checkpoint import formats, reader, sharded
from train.checkpoint.left_behind import only_local_line
from train.checkpoint.policy import choose_checkpoint
from train.checkpoint.state import Restored, TrainState, payload, rank_payload, set_rng_state
from train.core.config import check_checkpoint_config, to_dict
from train.core.config.resume import check_same_data
from train.core.errors import EXIT_OK, EXIT_ONLY_LOCAL
from train.core.run.protocol import Reporter
from train.core.storage.s3 import errors, said
from train.guards.divergence import Guard
from train.guards.watchdog import Watchdog
from train.loop.components import Components
from train.models import hf

log = logging.getLogger("train")


def save_checkpoint(c: Components, state: TrainState, guard: Guard,
                    watchdog: Watchdog | None = None, *, background: bool = False) -> None:
    """Collective: every rank calls it (full: FSDP gathers on rank 0; sharded: each rank
    writes its own shards). Weights that are not finite are never saved: the guard
    stops the run instead. ``watchdog``: told of the save's progress, part by part."""
    guard.weights(state.step, c.model, c.env.distributed)
    state.skipped_steps = guard.skipped
    model_state, optim_state, shards = c.checkpoint_format.collect(c.model, c.optimizer,
                                                                   background)
    shared = payload(state, world_size=c.env.world_size, model=model_state,
                     optimizer=optim_state, scheduler=c.scheduler.state_dict(),
                     scaler=c.scaler.state_dict() if c.scaler else None,
                     config=to_dict(c.cfg),
                     model_io={"input_shape": list(c.data.input_shape),
                               "num_classes": c.data.num_classes, **hf.model_io(c.model)},
                     format=c.checkpoint_format.name, data_sha256=c.data.data_hash)
    path = c.checkpointer.save(state.step, shared, rank_payload(c.env.rank),
                               background=background, shards=shards, watchdog=watchdog)
    if c.env.is_main:
        log.info("checkpoint %s: %s", "writing" if background else "saved", path)


def resume(c: Components) -> TrainState:
    """The progress to start from: a fresh state, or the chosen checkpoint's, loaded."""
    path, loaded = choose_checkpoint(
        c.checkpointer, c.cfg.checkpoint.resume_from, c.env, c.source,
        reads=lambda folder: sharded.files_read(c.model, c.optimizer, folder))
    if path is None:
        return TrainState()
    shared, mine = loaded if loaded is not None else reader.load(path, c.env.rank)
    saved = Restored(shared)
    check_checkpoint_config(c.cfg, saved.config, path, c.source)
    check_same_data(c.cfg, saved.data_sha256, c.data.data_hash, path, c.source)
    # in the format it was saved in: sharded reads what this rank's shards need, at any
    # world size
    formats.of_checkpoint(saved).load(c.model, c.optimizer, saved, path)
    c.scheduler.load_state_dict(saved.scheduler)
    if c.scaler and saved.scaler:
        c.scaler.load_state_dict(saved.scaler)
    state = saved.train_state(c.cfg.train.global_batch_size)
    if mine is not None and saved.world_size == c.env.world_size:
        set_rng_state(mine["rng"])
    else:  # resized: fresh per-rank streams, derived from the step so reruns agree
        torch.manual_seed(c.cfg.seed + 1 + c.env.rank + 7919 * state.step)
    log.info("resumed from %s at step %d, sample %d (saved with world size %s, now %d)", path,
             state.step, state.samples_consumed, saved.world_size, c.env.world_size)
    return state


def finish_uploads(c: Components, code: int, seconds_left: float, reporter: Reporter) -> int:
    """Rank 0 (node-local mode: each node's first rank) with ``checkpoint.remote``: wait
    for the upload in flight (the last checkpoint's); the worker's exit code.

    After a signal (``code`` 143), within half the grace period (the rest is the
    platform's margin); what stays only local is named in a warning. At the end of a
    run, within ``seconds_left`` (what is left of ``train.shutdown_timeout_s``, and at
    most half of ``distributed.timeout_s``, which the other ranks wait in their last
    barrier): a final checkpoint still only local then ends the run with
    EXIT_ONLY_LOCAL and one line (:mod:`.left_behind`), said by the launcher from the
    report (the worker itself exits 0, or torchrun would restart a finished run). Then
    (rank 0) the run's record once more, with what was logged after the last checkpoint
    (the final evaluation, result.json)."""
    tier = c.checkpointer.tier
    if tier is None:
        return code
    uploader = tier.uploader
    if code != EXIT_OK:
        behind = uploader.wait(c.cfg.distributed.grace_period_s / 2)
    else:
        behind = uploader.wait(min(seconds_left, c.cfg.distributed.timeout_s / 2), warn=False)
        if behind is not None:
            return _left_behind(c, behind, reporter)
    if behind is None and not uploader.unreachable and tier.nodes.publishes:
        try:
            uploader.mirror_record()
        except errors() as exc:  # the checkpoints are there; the record is a convenience
            log.warning("the run's metrics did not reach %s at the end (%s)", tier.where,
                        said(exc))
    return code


def _left_behind(c: Components, step: int, reporter: Reporter) -> int:
    """The final checkpoint ``step`` is only local: the launcher is told (and ends with
    EXIT_ONLY_LOCAL); a worker started without it says so and exits with it."""
    limit = c.cfg.train.shutdown_timeout_s
    line = only_local_line(step, c.checkpointer.tier.where, "its upload did not finish "
                           f"within train.shutdown_timeout_s={limit:g} after the last step "
                           "(raise it when uploads of this size need longer)")
    reporter.only_local = line
    if c.env.supervised:
        return EXIT_OK
    print(line, file=sys.stderr, flush=True)
    return EXIT_ONLY_LOCAL
