"""The training loop: build from config, wrap, resume, step, log, checkpoint, stop.

Runs the same in one plain process and under torchrun (DDP over gloo or nccl).
Gradient accumulation keeps ``train.global_batch_size`` whatever the world size, and
the data order is the global one from :mod:`train.data`, so a run resized or resumed
between steps continues exactly where it stopped.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from train import runtime
from train.autobatch import largest_fitting, probe_on_gpu
from train.checkpoint import Checkpointer, rng_state, set_rng_state
from train.config import AUTO, Config, batch_split, check_checkpoint_config, to_dict, to_yaml
from train.data import (DataBundle, GlobalOrder, RankBatchSampler, build_data, eval_indices,
                        make_loader)
from train.errors import ConfigError, EXIT_OK, EXIT_STOPPED_BY_SIGNAL
from train.manifest import update_manifest, write_json_atomic
from train.metrics import MetricsLogger
from train.models import build_model, count_parameters
from train.optim import build_optimizer, build_scheduler
from train.parallel import (apply_activation_checkpointing, full_state, load_full_state,
                            parallelize)

log = logging.getLogger("train")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class StopFlag:
    """Set by SIGTERM/SIGINT; ranks agree on it so that all stop after the same step.

    The agreement is an all-reduce (MAX). Run every step it cost 10-30 % of a small
    model's step time on gloo (measured with bench/ddp_overhead.py), so ranks agree every
    `every` steps instead, sized from the step time all ranks share (see
    :meth:`pace`) to about AGREE_EVERY_S: a signal stops training within about that long,
    well inside torchrun's ~30 s between SIGTERM and SIGKILL.
    """

    AGREE_EVERY_S = 0.5

    def __init__(self) -> None:
        self.requested = False
        self.every = 1

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            log.warning("received %s: stopping with a checkpoint", signal.Signals(signum).name)
        self.requested = True

    def pace(self, mean_step_time_s: float) -> None:
        """Called with the same value on every rank (an all-reduced mean), at the same step."""
        self.every = max(1, min(1000, int(self.AGREE_EVERY_S / max(mean_step_time_s, 1e-6))))

    def agreed(self, step: int, device: torch.device, distributed: bool) -> bool:
        if not distributed:
            return self.requested
        if step % self.every:
            return False
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class Watchdog:
    """Dumps every thread's stack and exits when a step makes no progress for timeout_s.

    Re-armed at most once a second: arming starts a thread, too costly for every step.
    """

    def __init__(self, timeout_s: int):
        self.timeout_s, self.armed_at = timeout_s, -math.inf

    def pet(self) -> None:
        now = time.monotonic()
        if now - self.armed_at >= 1.0:
            faulthandler.dump_traceback_later(self.timeout_s + 1, exit=True)
            self.armed_at = now

    def pause(self) -> None:
        """Disarm until the next pet() (which re-arms at once)."""
        faulthandler.cancel_dump_traceback_later()
        self.armed_at = -math.inf


@dataclass
class Parts:
    """Everything the loop needs, built once from config plus the runtime."""
    cfg: Config
    env: runtime.WorkerEnv
    device: torch.device
    data: DataBundle
    model: nn.Module          # wrapped (DDP / DataParallel / FSDP) or plain
    module: nn.Module         # the plain module inside
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    micro: int
    accum: int
    run_dir: Path
    checkpointer: Checkpointer
    start_step: int = 0
    start_sample: int = 0  # position in the global order where this attempt starts
    metrics: MetricsLogger | None = None
    stop: StopFlag = field(default_factory=StopFlag)

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def autocast(self):
        if self.cfg.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_DTYPES[self.cfg.precision])


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _barrier(env: runtime.WorkerEnv):
    return dist.barrier if env.distributed else (lambda: None)


def build(cfg: Config, env: runtime.WorkerEnv) -> Parts:
    micro, accum = batch_split(cfg, env.world_size)  # bad input fails before joining the group
    device = runtime.resolve_device(cfg, env)
    runtime.init_distributed(env, runtime.resolve_backend(cfg, device), device,
                             cfg.distributed.timeout_s,
                             single_process_group=cfg.distributed.strategy == "fsdp")
    env.check_consistent()
    torch.set_num_threads(runtime.cpus_per_rank(env))
    runtime.set_deterministic(cfg.deterministic)
    runtime.seed_everything(cfg.seed, env.rank)
    data = build_data(cfg)
    module = build_model(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    module.to(device)
    torch.manual_seed(cfg.seed + 1 + env.rank)  # per-rank dropout streams, after the shared init
    blocks = apply_activation_checkpointing(module, cfg.memory.activation_checkpointing,
                                            cfg.memory.activation_checkpointing_n)
    if blocks:
        log.info("activation checkpointing on %d blocks", blocks)
    if cfg.train.micro_batch_size == AUTO and device.type == "cuda" \
            and cfg.distributed.strategy != "fsdp":
        micro, accum = auto_micro_batch(cfg, env, module, data, device, micro * accum)
    model = parallelize(module, cfg, env, device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.train.max_steps)
    scaler = torch.amp.GradScaler(device.type) if cfg.precision == "fp16" else None
    run_dir = cfg.run_dir
    checkpointer = Checkpointer(run_dir, rank=env.rank, keep_last=cfg.checkpoint.keep_last,
                                world_size=env.world_size, barrier=_barrier(env),
                                async_timeout_s=cfg.distributed.timeout_s)
    return Parts(cfg, env, device, data, model, module, optimizer, scheduler, scaler, micro,
                 accum, run_dir, checkpointer)


def auto_micro_batch(cfg: Config, env: runtime.WorkerEnv, module: nn.Module, data: DataBundle,
                     device: torch.device, per_rank: int) -> tuple[int, int]:
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    # AdamW keeps two moments (SGD one); DDP adds gradient buckets the size of the grads.
    later_bytes = params * (2 if cfg.optim.name == "adamw" else 1) \
        + (params if env.distributed else 0)
    autocast = (lambda: torch.autocast("cuda", dtype=_DTYPES[cfg.precision])) \
        if cfg.precision != "fp32" else contextlib.nullcontext
    n = len(data.train)
    fits = probe_on_gpu(module, lambda m: data.train.__getitems__([i % n for i in range(m)]),
                        loss_fn, autocast, device, extra_bytes=later_bytes)
    micro = largest_fitting(per_rank, fits)
    if env.distributed:  # every rank must use the same size
        agreed = torch.tensor([micro], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        micro = int(agreed.item())
        micro = max(m for m in range(1, micro + 1) if per_rank % m == 0)
    log.info("train.micro_batch_size=auto: %d fits (per-rank batch %d)", micro, per_rank)
    return micro, per_rank // micro


# ------------------------------------------------------------------ checkpoints

def save_checkpoint(p: Parts, step: int, *, background: bool = False) -> None:
    model_state, optim_state = full_state(p.model, p.optimizer)
    consumed = p.start_sample + (step - p.start_step) * p.cfg.train.global_batch_size
    shared = {"step": step, "samples_consumed": consumed,
              "world_size": p.env.world_size, "model": model_state,
              "optimizer": optim_state, "scheduler": p.scheduler.state_dict(),
              "scaler": p.scaler.state_dict() if p.scaler else None, "config": to_dict(p.cfg),
              "model_io": {"input_shape": list(p.data.input_shape),
                           "num_classes": p.data.num_classes}}
    path = p.checkpointer.save(step, shared, {"rng": rng_state(), "rank": p.env.rank},
                               background=background)
    if p.is_main:
        log.info("checkpoint %s: %s", "writing" if background else "saved", path)


def _from_main(value, env: runtime.WorkerEnv):
    """Rank 0's value on every rank (decisions that must not differ between ranks)."""
    if not env.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def choose_checkpoint(p: Parts) -> Path | None:
    """Rank 0 picks the checkpoint and every rank loads that one: ranks deciding on their
    own could resume from different steps after one of them failed to read a file."""
    choice = p.cfg.checkpoint.resume_from
    if choice == "none" and p.env.restart_count > 0:
        choice = AUTO  # a restart of this attempt continues it instead of starting over
    if choice == "none":
        if p.is_main:
            moved = p.checkpointer.set_aside()
            if moved:
                log.warning("checkpoint.resume_from=none: earlier checkpoints moved to %s", moved)
        _barrier(p.env)()
        return None
    problem = None
    if p.is_main:
        if choice == AUTO:
            path = p.checkpointer.newest_valid()
        else:
            path, problem = Path(choice), Checkpointer.verify(Path(choice))
    path, problem = _from_main((str(path) if p.is_main and path else None, problem), p.env)
    if problem:
        raise ConfigError(p.cfg.source, "checkpoint.resume_from", f"{choice}: {problem}")
    return Path(path) if path else None


def resume(p: Parts) -> None:
    path = choose_checkpoint(p)
    if path is None:
        return
    shared, mine = Checkpointer.load(path, p.env.rank)
    check_checkpoint_config(p.cfg, shared.get("config", {}), path)
    load_full_state(p.model, p.optimizer, shared["model"], shared["optimizer"])
    p.scheduler.load_state_dict(shared["scheduler"])
    if p.scaler and shared.get("scaler"):
        p.scaler.load_state_dict(shared["scaler"])
    p.start_step = int(shared["step"])
    p.start_sample = int(shared.get("samples_consumed",
                                    p.start_step * p.cfg.train.global_batch_size))
    same_world = shared.get("world_size") == p.env.world_size
    if mine is not None and same_world:
        set_rng_state(mine["rng"])
    else:  # resized: fresh per-rank streams, derived from the step so reruns agree
        torch.manual_seed(p.cfg.seed + 1 + p.env.rank + 7919 * p.start_step)
    log.info("resumed from %s at step %d, sample %d (saved with world size %s, now %d)", path,
             p.start_step, p.start_sample, shared.get("world_size"), p.env.world_size)


# ------------------------------------------------------------------------ steps

def gradient_sync(model: nn.Module, enabled: bool):
    """Skip the gradient all-reduce on non-final micro-steps (DDP no_sync; FSDP2 keeps
    unsharded gradients until the last one)."""
    if isinstance(model, DDP):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 module
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def train_step(p: Parts, batches) -> torch.Tensor:
    """One optimizer step over `accum` micro-batches; returns this rank's mean loss."""
    total = torch.zeros((), device=p.device)
    for i in range(p.accum):
        x, y = next(batches)
        x = x.to(p.device, non_blocking=True)
        y = y.to(p.device, non_blocking=True)
        with gradient_sync(p.model, enabled=i == p.accum - 1):
            with p.autocast():
                loss = loss_fn(p.model(x), y) / p.accum
            (p.scaler.scale(loss) if p.scaler else loss).backward()
        total += loss.detach()
    return total


def optimizer_step(p: Parts, want_norm: bool) -> float | None:
    clip = p.cfg.optim.grad_clip
    norm = None
    if p.scaler:
        p.scaler.unscale_(p.optimizer)
    if clip > 0 or want_norm:
        norm = torch.nn.utils.clip_grad_norm_(p.model.parameters(), clip if clip > 0 else math.inf)
    if p.scaler:
        p.scaler.step(p.optimizer)
        p.scaler.update()
    else:
        p.optimizer.step()
    p.scheduler.step()
    p.optimizer.zero_grad(set_to_none=True)
    return None if norm is None else float(norm)


def gpu_memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory of this logging interval (rank 0's GPU), then reset for the next one."""
    if device.type != "cuda":
        return {}
    stats = {"gpu/peak_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
             "gpu/reserved_gb": torch.cuda.memory_reserved(device) / 2**30}
    torch.cuda.reset_peak_memory_stats(device)
    return stats


def mean_over_ranks(values: list[torch.Tensor | float], device: torch.device,
                    distributed: bool) -> list[float]:
    """One all-reduce for several scalars (loss, step time, ...)."""
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(())
                           for v in values])
    if distributed:
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
        stacked /= dist.get_world_size()
    return stacked.tolist()


@torch.no_grad()
def evaluate(p: Parts) -> dict[str, float]:
    cfg, env = p.cfg, p.env
    total = min(len(p.data.val), cfg.train.eval_batches * cfg.train.global_batch_size)
    idx = eval_indices(len(p.data.val), cfg.train.eval_batches, cfg.train.global_batch_size,
                       env.rank, env.world_size)
    # Every rank runs the same number of forwards (FSDP gathers parameters in each one);
    # a rank whose share ran out evaluates sample 0 with weight 0.
    n_batches = math.ceil(math.ceil(total / env.world_size) / p.micro)
    p.module.eval()
    sums = torch.zeros(3, device=p.device)  # loss x n, correct, n
    for i in range(n_batches):
        chunk = idx[i * p.micro: (i + 1) * p.micro]
        x, y = p.data.val.__getitems__(chunk or [0])
        x, y = x.to(p.device), y.to(p.device)
        with p.autocast():
            logits = p.module(x)
        if chunk:
            sums[0] += loss_fn(logits, y) * y.numel()
            sums[1] += (logits.argmax(-1) == y).sum()
            sums[2] += y.numel()
    p.module.train()
    if env.distributed:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    if sums[2] == 0:
        return {}
    return {"val/loss": float(sums[0] / sums[2]), "val/accuracy": float(sums[1] / sums[2])}


def train_loader(p: Parts):
    cfg, env = p.cfg, p.env
    order = GlobalOrder(len(p.data.train), cfg.seed)
    sampler = RankBatchSampler(order, global_batch_size=cfg.train.global_batch_size,
                               rank=env.rank, world_size=env.world_size,
                               micro_batch_size=p.micro, start_step=p.start_step,
                               end_step=cfg.train.max_steps, first_sample=p.start_sample)
    workers = cfg.data.num_workers
    if workers == AUTO:
        workers = min(4, runtime.cpus_per_rank(env) // 2)
    pin = cfg.data.pin_memory
    pin = p.device.type == "cuda" if pin == AUTO else pin
    return make_loader(p.data.train, sampler, num_workers=workers, pin_memory=pin,
                       persistent_workers=cfg.data.persistent_workers,
                       prefetch_factor=cfg.data.prefetch_factor, seed=cfg.seed)


# ------------------------------------------------------------------------- loop

def prepare_run_dir(p: Parts) -> None:
    if p.is_main:
        p.run_dir.mkdir(parents=True, exist_ok=True)
    _barrier(p.env)()


def start_logging(p: Parts) -> None:
    """After a successful resume: config.yaml then always describes loadable checkpoints."""
    if not p.is_main:
        return
    (p.run_dir / "config.yaml").write_text(to_yaml(p.cfg))
    update_manifest(p.run_dir, p.cfg, data_hash=p.data.data_hash,
                    data_description=p.data.description, world_size=p.env.world_size,
                    start_step=p.start_step, restart_count=p.env.restart_count,
                    build_manifest_path=p.env.build_manifest,
                    explicit_code_version=p.env.code_version)
    unit = "tokens" if p.data.tokens_per_sample else "samples"
    p.metrics = MetricsLogger(p.cfg, p.run_dir, p.start_step, throughput_unit=unit)
    log.info("model %s: %s parameters | data %s | world size %d | micro-batch %d x %d "
             "accumulation | device %s | precision %s", p.cfg.model.kind,
             f"{count_parameters(p.module):,}", p.data.description, p.env.world_size, p.micro,
             p.accum, p.device, p.cfg.precision)


def run_loop(p: Parts) -> int:
    cfg = p.cfg
    every_log, every_eval = cfg.logging.every_steps, cfg.train.eval_every_steps
    every_ckpt = cfg.checkpoint.every_steps
    samples_per_step = cfg.train.global_batch_size * max(1, p.data.tokens_per_sample)
    batches = iter(train_loader(p))
    last_time, last_step = time.perf_counter(), p.start_step
    step = p.start_step
    watchdog = Watchdog(cfg.distributed.timeout_s)
    while step < cfg.train.max_steps:
        watchdog.pet()
        loss = train_step(p, batches)
        step += 1
        log_now = step % every_log == 0 or step == cfg.train.max_steps
        lr = p.scheduler.get_last_lr()[0]  # the rate this step's update uses
        norm = optimizer_step(p, want_norm=log_now)
        if log_now:
            now = time.perf_counter()
            loss_value, step_time = mean_over_ranks(
                [loss, (now - last_time) / (step - last_step)], p.device, p.env.distributed)
            last_time, last_step = now, step
            p.stop.pace(step_time)
            if p.metrics:
                values = {"loss": loss_value, "lr": lr}
                if norm is not None:
                    values["grad_norm"] = norm
                values["throughput"] = samples_per_step / step_time
                values.update(gpu_memory_stats(p.device))
                p.metrics.log(step, values, step_time=step_time)
        # Evaluation and saving can outlast a step by far: the watchdog guards steps only.
        watchdog.pause()
        if every_eval and step % every_eval == 0 and step < cfg.train.max_steps:
            _log_eval(p, step)
        # A signal during the final step changes nothing: the run finishes normally.
        stopping = p.stop.agreed(step, p.device, p.env.distributed) \
            and step < cfg.train.max_steps
        last = stopping or step == cfg.train.max_steps
        if last or (every_ckpt and step % every_ckpt == 0):
            # The last checkpoint is written in the foreground: exit 0 or 143 means saved.
            save_checkpoint(p, step, background=cfg.checkpoint.async_save and not last)
        if stopping:
            log.warning("stopped at step %d by a signal; rerun the same command to resume", step)
            return EXIT_STOPPED_BY_SIGNAL
    finish(p, step)
    return EXIT_OK


def finish(p: Parts, step: int) -> None:
    """Final evaluation, hparams and result.json (also for a rerun of a run whose final
    checkpoint was written but whose finish was interrupted)."""
    final = _log_eval(p, step)
    if p.metrics:
        p.metrics.close({"loss": final.get("val/loss", float("nan"))} if final else None)
        write_json_atomic(p.run_dir / "result.json", {"step": step, **final})


def _log_eval(p: Parts, step: int) -> dict[str, float]:
    if p.cfg.train.eval_batches == 0:
        return {}
    values = evaluate(p)
    if p.metrics and values:
        p.metrics.log_eval(step, values)
    return values


def train(cfg: Config, env: runtime.WorkerEnv | None = None) -> int:
    env = env or runtime.WorkerEnv.from_environ()
    runtime.configure_logging(env.rank)
    faulthandler.enable(all_threads=True)  # a crash (SIGSEGV, SIGABRT) shows every stack
    stop = StopFlag()
    stop.install()  # before the slow build, so an early SIGTERM is not lost
    clean = False
    try:
        p = build(cfg, env)
        p.stop = stop
        prepare_run_dir(p)
        resume(p)
        start_logging(p)
        if p.start_step >= cfg.train.max_steps:
            log.info("nothing to do: the run already reached step %d", p.start_step)
            if _from_main(not (p.run_dir / "result.json").exists(), env):
                finish(p, p.start_step)
            elif p.metrics:
                p.metrics.close()
            code = EXIT_OK
        else:
            code = run_loop(p)
        p.checkpointer.wait()
        clean = True
        return code
    finally:
        sys.stdout.flush()
        runtime.shutdown_distributed(clean)
