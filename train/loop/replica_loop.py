"""The training loop of replica groups (``distributed.fault_tolerance: replicas``): each
step a transaction over a fixed logical batch.

A step: join the quorum (a group that restarted heals from a live peer first) -> compute
this group's slots of the fixed global batch (:mod:`train.distributed.replica_slots`;
survivors of a loss compute the lost slots too, a spare beyond the slots computes none)
-> one all-reduce (SUM) across the groups of the gradients, the loss, the stop flag and
who computed each slot -> commit, or not: a step that failed anywhere this group saw is
not applied, and the next quorum trains the same samples again. Gradients are scaled
by ``1 / global_batch_size`` before the sum, so the update is that of the fault-free run
whichever groups computed it.

Committed steps are written to ``RUN_DIR/ledger.jsonl`` (:mod:`train.observe.ledger`)
and checkpoints by the step's first participating group; replica group 0's rank 0 logs
the metrics and writes the run's files. Inside a group: one process, DDP, or FSDP (each
rank's shards summed with the same rank of the other groups).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from train.checkpoint.policy import Cadence
from train.checkpoint.session import save_checkpoint
from train.checkpoint.state import TrainState
from train.core.errors import EXIT_OK, EXIT_PEER_STOPPED, EXIT_STOPPED_BY_SIGNAL
from train.data.prefetch import StepReader, open_reader
from train.distributed.replica_group import Quorum, ReplicaGroup
from train.distributed.replica_shards import local_grads, model_state, optimizer_state, portable
from train.distributed.replica_slots import micro_spans, slot_span, slots_of
from train.guards.divergence import Guard
from train.guards.stopping import StopFlag
from train.guards.watchdog import CHECKPOINT, EVALUATION, Watchdog
from train.loop.components import Components, loader_workers, train_order
from train.loop.replica_quorum import (
    any_rank,
    finished_without_us,
    first_quorum,
    joins_running,
    rejoin,
    say_absent,
    say_membership,
)
from train.loop.steps import finish, gradient_sync, log_eval, optimizer_step
from train.observe.ledger import Entry, Ledger, ledger_path
from train.observe.metrics import MetricsLogger

log = logging.getLogger("train")

# The values summed with the gradients after them: the loss summed over the batch's
# samples, the stop flag, then one per slot: 1 + the id of the group that computed it.
LOSS, STOP, OWNERS = 0, 1, 2


def heal_state(c: Components, state: TrainState, ledger: Ledger | None):
    """What a group behind the others receives from a live peer, and how it takes it in:
    the training state, and the peer's recent ledger entries (a step the peer committed
    and this group did not, when this group writes the ledger next, must get its line)."""
    def save() -> dict[str, Any]:
        # under FSDP: this rank's shards, which the same rank of the healing group takes
        return {"model": portable(c.module.state_dict()),
                "optimizer": portable(c.optimizer.state_dict()),
                "scheduler": c.scheduler.state_dict(),
                "scaler": c.scaler.state_dict() if c.scaler else None,
                "progress": state.state_dict(),
                "ledger": ledger.recent_entries() if ledger is not None else []}

    def load(saved: dict[str, Any]) -> None:
        c.module.load_state_dict(model_state(saved["model"], c.module))
        c.optimizer.load_state_dict(optimizer_state(saved["optimizer"], c.optimizer))
        c.scheduler.load_state_dict(saved["scheduler"])
        if c.scaler and saved["scaler"] is not None:
            c.scaler.load_state_dict(saved["scaler"])
        state.load_state_dict(saved["progress"], c.cfg.train.global_batch_size)
        if ledger is not None:
            ledger.adopt(saved["ledger"])
        # at step 0, torchft's start-up sync of groups that start equal: not worth a line
        log.log(logging.INFO if state.step else logging.DEBUG,
                "replica group %d healed from a live peer at step %d",
                c.env.replica_group or 0, state.step)
    return save, load


def data_reader(c: Components, state: TrainState) -> StepReader:
    """What reads this rank's micro-batches (:mod:`train.data.prefetch`): loaded ahead by
    ``data.num_workers`` loader workers, predicting the group's own slot (a spare's:
    none; a restarted group heals to the live step first: none), or read in this process."""
    cfg, env = c.cfg, c.env
    g, replicas = cfg.train.global_batch_size, cfg.distributed.replicas
    group = env.replica_group or 0
    workers, pin = loader_workers(c)

    def chunks(first: int, slots: list[int]) -> list[tuple[int, int]]:
        return micro_spans(first, g, replicas, slots, env.rank, env.world_size, c.micro)
    return open_reader(c.data.train, train_order(c), chunks, step_size=g,
                       first=state.samples_consumed, end=end_of_run(c, state),
                       slots=[] if env.restart_count or group >= replicas else [group],
                       num_workers=workers, pin_memory=pin,
                       prefetch_factor=cfg.data.prefetch_factor, seed=cfg.seed)


def end_of_run(c: Components, state: TrainState) -> int:
    """The position in the sample order where the run's last step ends."""
    g = c.cfg.train.global_batch_size
    return state.samples_consumed + (c.cfg.train.max_steps - state.step) * g


def compute_slots(c: Components, reader: StepReader, first: int, slots: list[int],
                  end: int) -> float:
    """Forward and backward over this rank's part of ``slots``; the gradients hold the
    sum of its samples' losses / global batch (DDP or FSDP inside the group averages its
    ranks: so each rank's loss is scaled by the group's size). Returns the summed loss."""
    g = c.cfg.train.global_batch_size
    spans = reader.step(first, slots, end)
    total = 0.0
    for i, (lo, hi) in enumerate(spans):
        x, y = reader.batch((lo, hi))
        x, y = x.to(c.device, non_blocking=True), y.to(c.device, non_blocking=True)
        with gradient_sync(c.model, enabled=i == len(spans) - 1):
            with c.autocast():
                loss = c.objective(c.model, x, y)[0]
            scaled = loss * ((hi - lo) * c.env.world_size / g)
            (c.scaler.scale(scaled) if c.scaler else scaled).backward()
        total += float(loss.detach()) * (hi - lo)
    return total


def sum_across_groups(c: Components, group: ReplicaGroup, extras: list[float]) -> torch.Tensor:
    """One all-reduce of every gradient and ``extras``; the summed gradients are written
    back. Returns the summed extras. Under FSDP each rank sums its local gradient shards
    with the same rank of the other groups, whose shards are the same pieces
    (:mod:`train.distributed.replica_shards`)."""
    grads = local_grads([p for p in c.model.parameters() if p.requires_grad])
    flat = torch.cat([g.reshape(-1).float() for g in grads]
                     + [torch.tensor(extras, dtype=torch.float32, device=c.device)])
    group.sum(flat)
    offset = 0
    with torch.no_grad():
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
    return flat[offset:].cpu()


def record(ledger: Ledger | None, quorum: Quorum, step: int, first: int, c: Components,
           owners: torch.Tensor, durable: bool) -> None:
    """The committed step in the ledger; written when this group is the step's writer."""
    if ledger is None:
        return
    g, replicas = c.cfg.train.global_batch_size, c.cfg.distributed.replicas
    ledger.committed(Entry(step, [list(slot_span(first, g, replicas, s)) for s in range(replicas)],
                           [round(float(o)) - 1 for o in owners]))
    if quorum.participant == 0:
        ledger.write(durable=durable)
    else:
        ledger.step_down()


class ReplicaLoop:
    """Train to train.max_steps or to a stop any group asked for: one attempt at a step
    after another, each committed everywhere it did not fail, or tried again."""

    def __init__(self, c: Components, state: TrainState, stop: StopFlag,
                 metrics: MetricsLogger | None, guard: Guard, watchdog: Watchdog,
                 group: ReplicaGroup, ledger: Ledger | None, reader: StepReader):
        self.c, self.state, self.stop, self.metrics = c, state, stop, metrics
        self.guard, self.watchdog, self.group, self.ledger = guard, watchdog, group, ledger
        self.reader, self.cadence = reader, Cadence.from_config(c.cfg)
        self.expected = c.env.replica_groups or c.cfg.distributed.replicas

    def run(self) -> int:
        c, state = self.c, self.state
        self.group.start_at(state.step)
        start, wait = state.step, c.cfg.distributed.replica_timeout_s
        if c.env.restart_count:  # torchrun restarted this group alone: the others train on
            pending = rejoin(self.group, self.expected, wait)
        else:
            pending = first_quorum(self.group, self.expected, wait, start)
            say_absent(c, pending, self.expected, wait, start)
        if finished_without_us(c, pending, self.expected):
            return EXIT_OK  # before the ledger: its lines are the finished run's
        if self.ledger is not None and pending.participant == 0 and \
                not joins_running(pending, start):
            self.ledger.restart_at(state.step)  # no live group ahead: those after are redone
        seen = pending.participants
        while state.step < c.cfg.train.max_steps:
            self.watchdog.pet(state.step)
            quorum, pending = pending or self.group.quorum(), None
            seen = say_membership(c, quorum, self.expected, seen)
            if finished_without_us(c, quorum, self.expected):
                return EXIT_OK
            code = self.attempt(quorum)
            if code is not None:
                return code
        with self.watchdog.watching(EVALUATION, state.step):
            final = finish(c, self.metrics, state.step, self.watchdog.progress)
        self.watchdog.pause()
        if self.metrics is not None:
            self.metrics.close(final)
        return EXIT_OK

    def attempt(self, quorum: Quorum) -> int | None:
        """Compute this group's slots, sum across the groups, commit or not. An exit code
        when the run stops after this step."""
        c, started = self.c, time.perf_counter()
        replicas = c.cfg.distributed.replicas
        first = self.state.samples_consumed
        mine = slots_of(quorum.participant, quorum.participants, replicas)
        loss_sum = compute_slots(c, self.reader, first, mine, end_of_run(c, self.state))
        owners = [self.group.group_id + 1.0 if s in mine else 0.0 for s in range(replicas)]
        # the group's ranks stop at one step: each sums its flag with the same rank of
        # the other groups only, and a signal reaches one rank a moment before another
        stop = any_rank(self.stop.requested, c.device)
        summed = sum_across_groups(c, self.group, [loss_sum, float(stop), *owners])
        if not self.group.commit():
            log.warning("step %d not committed (%s); trained again with the next quorum",
                        self.state.step + 1, self.group.failure() or "a group failed")
            c.optimizer.zero_grad(set_to_none=True)
            return None
        return self.committed(quorum, first, summed, started)

    def committed(self, quorum: Quorum, first: int, summed: torch.Tensor,
                  started: float) -> int | None:
        """Apply the step everywhere it committed: update, ledger, logs, evaluation,
        checkpoint (by the step's first group), and the agreed stop."""
        c, state, watchdog = self.c, self.state, self.watchdog
        cfg = c.cfg
        step = state.step + 1
        lr = c.scheduler.get_last_lr()[0]
        norm, applied = optimizer_step(c, self.guard, step)
        state.advance(cfg.train.global_batch_size)
        last = step == cfg.train.max_steps
        stopping = bool(summed[STOP] > 0) and not last
        how = self.cadence.due(step, stopping or last)
        record(self.ledger, quorum, step, first, c, summed[OWNERS:], durable=how is not None)
        log_step(c, self.metrics, self.guard, step,
                 {"loss": float(summed[LOSS]) / cfg.train.global_batch_size, "lr": lr,
                  "grad_norm": norm}, time.perf_counter() - started, applied)
        every_eval = cfg.train.eval_every_steps
        if every_eval and step % every_eval == 0 and not last:  # every group: in step
            with watchdog.watching(EVALUATION, step):
                log_eval(c, self.metrics, step, watchdog.progress)
        if how is not None and quorum.participant == 0:  # one group writes it
            with watchdog.watching(CHECKPOINT, step):
                save_checkpoint(c, state, self.guard, watchdog, background=how == "background")
        return stopped(step, self.stop, watchdog) if stopping else None


def stopped(step: int, stop: StopFlag, watchdog: Watchdog) -> int:
    """The exit code of a stop every group agreed on at ``step``."""
    watchdog.pause()  # what follows has its own bounds
    if not stop.requested:
        log.info("stopped at step %d: another replica group was told to stop", step)
        return EXIT_PEER_STOPPED
    log.warning("stopped at step %d by a signal; rerun the same command to resume", step)
    return EXIT_STOPPED_BY_SIGNAL


def log_step(c: Components, metrics: MetricsLogger | None, guard: Guard, step: int,
             values: dict[str, float], step_time: float, applied: bool) -> None:
    """The step's line and metrics, by replica group 0's rank 0 (every group's values are
    the same: the loss was summed across them)."""
    cfg = c.cfg
    if metrics is not None and metrics.per_step:
        metrics.step(step)
    if not (step % cfg.logging.every_steps == 0 or step in (1, cfg.train.max_steps)):
        return
    guard.loss(step, values["loss"], applied)
    if metrics is not None:
        values["throughput"] = cfg.train.global_batch_size * max(1, c.data.tokens_per_sample) \
            / step_time
        metrics.log(step, values, step_time=step_time, ranks=None)


def run_replicas(c: Components, state: TrainState, stop: StopFlag,
                 metrics: MetricsLogger | None, guard: Guard, watchdog: Watchdog) -> int:
    """This group's seat (a torchft Manager) for the run, then the loop. The loader's
    workers start first (forked before torchft's threads), and end with the loop, within
    the shutdown's bound."""
    reader = data_reader(c, state)
    try:
        ledger = Ledger(ledger_path(c.run_dir)) if c.env.is_main else None
        save, load = heal_state(c, state, ledger)
        group = ReplicaGroup(c.cfg, c.env, c.device, save, load)
        try:
            return ReplicaLoop(c, state, stop, metrics, guard, watchdog, group, ledger,
                               reader).run()
        finally:
            group.close()
    finally:
        if reader.summary() and c.env.rank == 0:  # one line a group
            log.info("%s", reader.summary())
        stop.shutdown.abandon(reader.close(stop.shutdown.seconds_left))
