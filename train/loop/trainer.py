"""The training loop: resume, step, log, evaluate, checkpoint, stop.

Runs the same in one plain process and under torchrun (DDP or FSDP over gloo or nccl).
Its parts are built by :mod:`train.loop.components`; its progress, a
:class:`~train.checkpoint.state.TrainState`, is saved with the checkpoint. Gradient
accumulation keeps ``train.global_batch_size`` at any world size, and the data order is
the global one of :mod:`train.data.order`: a run resized or resumed between steps goes on
exactly where it stopped. Multi-node runs pass the preflight check
(:mod:`train.guards.preflight`, naming slow or bad nodes) before step 1."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import sys
from pathlib import Path

import torch

from train.checkpoint.left_behind import Run, upload_left_behind
from train.checkpoint.policy import Cadence
from train.checkpoint.session import finish_uploads, resume, save_checkpoint
from train.checkpoint.state import TrainState
from train.core.config import AUTO, Config, to_yaml
from train.core.errors import EXIT_OK, EXIT_PEER_STOPPED, EXIT_STOPPED_BY_SIGNAL, Diverged
from train.core.files import finished_step, write_atomic
from train.core.run import rundir, runlock
from train.core.run.identity import WorkerIdentity
from train.core.run.protocol import Reporter
from train.core.user import usercode
from train.data.loader import end_workers
from train.distributed import ranks
from train.guards.divergence import Guard, clear_marker, read_marker, write_marker
from train.guards.preflight import check_before_training
from train.guards.shutdown import Shutdown
from train.guards.stopping import StopFlag
from train.guards.watchdog import CHECKPOINT, EVALUATION, Watchdog
from train.loop.components import Components, build, preflight, train_loader
from train.loop.replica_loop import run_replicas
from train.loop.steps import finish, log_eval, optimizer_step, train_step
from train.models import count_parameters
from train.observe.intervals import Intervals
from train.observe.manifest import update_manifest
from train.observe.metrics import MetricsLogger, gpu_memory_stats

log = logging.getLogger("train")


# ------------------------------------------------------------------------ steps

# ------------------------------------------------------------------------- loop

def start_logging(c: Components, state: TrainState, shutdown: Shutdown) -> MetricsLogger | None:
    """After a successful resume, so config.yaml always describes loadable checkpoints.
    Rank 0 writes the run's files and gets the metrics logger; other ranks get None."""
    if not c.env.leads_run:
        return None
    write_atomic(c.run_dir / rundir.CONFIG, to_yaml(c.cfg))
    update_manifest(c.run_dir, c.cfg, data_hash=c.data.data_hash,
                    data_description=c.data.description, world_size=c.env.world_size,
                    start_step=state.step, restart_count=c.env.restart_count,
                    build_manifest_path=c.env.build_manifest,
                    explicit_code_version=c.env.code_version,
                    user_code=usercode.imported_files())
    unit = "tokens" if c.data.tokens_per_sample else "samples"
    log.info("model %s: %s parameters | data %s | world size %s | micro-batch %d x %d "
             "accumulation | device %s | precision %s | %d CPU thread(s)", c.cfg.model.kind,
             f"{count_parameters(c.module):,}", c.data.description, world_text(c), c.micro,
             c.accum, c.device, c.cfg.precision, torch.get_num_threads())
    return MetricsLogger(c.cfg, c.run_dir, state.step, throughput_unit=unit, shutdown=shutdown)


def world_text(c: Components) -> str:
    """The world size, and with replica groups how many share each batch."""
    d = c.cfg.distributed
    if d.fault_tolerance != "replicas":
        return str(c.env.world_size)
    spares = f" + {d.spares} spare(s)" if d.spares else ""
    return f"{c.env.world_size} in each of {d.replicas} replica groups{spares}"


def checkpoint_bytes(c: Components) -> int:
    """Roughly what a checkpoint writes: the weights and two optimizer moments per
    parameter (Adam's), in float32; the hang watchdog's allowance for writing them."""
    return 3 * 4 * count_parameters(c.module)


def make_guard(c: Components, state: TrainState) -> Guard:
    def last_good() -> Path | None:
        step = c.checkpointer.latest_step()
        return None if step is None else c.checkpointer.dir / rundir.step_name(step)
    return Guard(mode=c.cfg.train.nonfinite, max_skips=c.cfg.train.max_skipped_steps,
                 scaled=c.scaler is not None, skipped=state.skipped_steps, run_dir=c.run_dir,
                 last_good=last_good, grad_clip=c.cfg.optim.grad_clip)


def run_loop(c: Components, state: TrainState, stop: StopFlag,
             metrics: MetricsLogger | None, guard: Guard, watchdog: Watchdog) -> int:
    """Train to train.max_steps, or to a stop; the loader's workers end with it, within
    the shutdown's bound (a worker stuck on its way out is killed)."""
    batches = iter(train_loader(c, state))
    try:
        return train_steps(c, state, stop, metrics, guard, watchdog, batches)
    finally:
        stop.shutdown.abandon(end_workers(batches, stop.shutdown.seconds_left))


def train_steps(c: Components, state: TrainState, stop: StopFlag,
                metrics: MetricsLogger | None, guard: Guard, watchdog: Watchdog,
                batches) -> int:
    cfg, env = c.cfg, c.env
    every_log, every_eval = cfg.logging.every_steps, cfg.train.eval_every_steps
    cadence = Cadence.from_config(cfg)
    samples_per_step = cfg.train.global_batch_size * max(1, c.data.tokens_per_sample)
    intervals = Intervals(cfg, env, c.device, state.step, c.model, c.preflight_links,
                          c.fetched)
    while state.step < cfg.train.max_steps:
        watchdog.pet(state.step)
        loss = train_step(c, batches, intervals.phases)
        state.advance(cfg.train.global_batch_size)
        step = state.step
        # step 1 too: the starting loss, and the first sign that training runs
        log_now = step % every_log == 0 or step in (1, cfg.train.max_steps)
        lr = c.scheduler.get_last_lr()[0]  # the rate this step's update uses
        norm, applied = intervals.phases.update(optimizer_step, c, guard, step)
        if metrics is not None and metrics.per_step:
            metrics.step(step)
        if log_now:
            loss_value, step_time, named, anyone = intervals.end(step, loss, stop.requested)
            stop.pace(step_time, step, anyone)  # this step's stop agreement rode on the gather
            watchdog.pace(step_time)
            guard.loss(step, loss_value, applied)
            if env.is_main:
                values = {"loss": loss_value, "lr": lr, "grad_norm": norm}
                values["throughput"] = samples_per_step / step_time
                values.update(gpu_memory_stats(c.device) | intervals.data)
                metrics.log(step, values, step_time=step_time,
                            ranks=intervals.judge.worst if env.distributed else None)
                for finding in named:  # stragglers and slow links
                    metrics.named(finding)
        if every_eval and step % every_eval == 0 and step < cfg.train.max_steps:
            with watchdog.watching(EVALUATION, step):
                log_eval(c, metrics, step, watchdog.progress)
        # A signal during the final step changes nothing: the run finishes normally.
        stopping = stop.agreed(step, c.device, env.distributed) and step < cfg.train.max_steps
        last = stopping or step == cfg.train.max_steps
        how = cadence.due(step, last)
        if how is not None:  # the last one in the foreground: exit 0 or 143 means saved
            with watchdog.watching(CHECKPOINT, step):
                save_checkpoint(c, state, guard, watchdog, background=how == "background")
        if stopping:
            watchdog.pause()  # what follows has its own bounds
            if not stop.requested:  # another node leaves; this one goes on without it
                log.info("stopped at step %d: another node's workers were told to stop", step)
                return EXIT_PEER_STOPPED
            log.warning("stopped at step %d by a signal; rerun the same command to resume", step)
            return EXIT_STOPPED_BY_SIGNAL
    with watchdog.watching(EVALUATION, state.step):
        final = finish(c, metrics, state.step, watchdog.progress)
    watchdog.pause()  # the trackers' close has the shutdown's bound, a background save its own
    if metrics is not None:
        metrics.close(final)
    return EXIT_OK


def refuse_a_diverged_restart(c: Components) -> None:
    """torchrun restarts workers whatever their exit code; a restart of an attempt that
    diverged would diverge again, so it ends at once. A new run clears the marker."""
    if c.env.continuing:
        message = read_marker(c.run_dir)
        if message:
            raise Diverged(message.removeprefix("error: "))
    ranks.barrier(c.env)()  # every rank read it before rank 0 may remove it
    if c.env.leads_run:
        clear_marker(c.run_dir)


def train(cfg: Config, source: str, env: WorkerIdentity | None = None,
          reporter: Reporter | None = None) -> int:
    """One worker's whole run. ``source``: the config file, named in error messages;
    ``reporter``: how the rank tells the launcher its progress and hangs."""
    env = env or WorkerIdentity.from_environ()
    reporter = reporter or Reporter(env)
    ranks.configure_logging(env.rank)
    faulthandler.enable(all_threads=True)  # a crash (SIGSEGV, SIGABRT) shows every stack
    shutdown = Shutdown(cfg.train.shutdown_timeout_s)
    stop = StopFlag(shutdown, cfg.logging.every_steps)
    stop.install()  # before the slow build, so an early SIGTERM is not lost
    clean = False
    c, metrics, lock = None, None, None
    try:
        placed = preflight(cfg, env, source)
        if env.is_main and not env.supervised:  # the launcher holds it otherwise
            lock = runlock.acquire(cfg.run_dir, env.elastic_run_id,
                                   runlock.LeaseTimes.of(cfg), log=log.warning)
        done = finished_step(cfg.run_dir, cfg.train.max_steps) \
            if cfg.checkpoint.resume_from == AUTO else None  # none or a path: train as asked
        if done is not None and env.world_size == 1:  # (the launcher checks before starting)
            log.info("nothing to do: run %s finished at step %d (%s); raise train.max_steps "
                     "to train on", cfg.run.name, done, cfg.run_dir / rundir.RESULT)
            clean = True
            return upload_left_behind(Run.of(cfg))  # the final one, if the store lacks it
        c = build(cfg, env, source, placed)  # the run directory prepared too
        refuse_a_diverged_restart(c)
        watchdog = Watchdog(cfg.distributed.timeout_s, reporter, state_bytes=checkpoint_bytes(c))
        c = c.with_preflight(check_before_training(cfg, env, c.device, c.run_dir, watchdog))
        state = resume(c)
        metrics = start_logging(c, state, shutdown)
        guard = make_guard(c, state)
        if state.step >= cfg.train.max_steps:
            log.info("nothing to do: the run already reached step %d", state.step)
            final = finish(c, metrics, state.step) \
                if ranks.from_main(not (c.run_dir / rundir.RESULT).exists(), env) else None
            if metrics is not None:
                metrics.close(final)
            code = EXIT_OK
        elif cfg.distributed.fault_tolerance == "replicas":
            code = run_replicas(c, state, stop, metrics, guard, watchdog)
        else:
            code = run_loop(c, state, stop, metrics, guard, watchdog)
        if metrics is not None:  # stopped by a signal, or by another node: resumable
            metrics.close(status="KILLED")
        c.checkpointer.wait()
        code = finish_uploads(c, code, shutdown.seconds_left(), reporter)
        clean = True
        return code
    except Diverged as exc:
        # Every rank reached the same verdict at the same step: a coordinated stop.
        c.checkpointer.wait()
        if env.is_main:
            write_marker(c.run_dir, c.checkpointer.latest_step() or 0, exc.one_line())
            if metrics is not None:
                metrics.close(status="FAILED")
        clean = True
        raise
    finally:
        if metrics is not None and not clean:  # a failure: the trackers say so
            with contextlib.suppress(Exception):
                metrics.close(status="FAILED")
        shutdown.report()
        sys.stdout.flush()
        ranks.shutdown_distributed(clean)
        if lock is not None:
            lock.release()
