"""One optimizer step's parts, evaluation and the run's closing lines: what the loop of
:mod:`train.loop.trainer` and that of replica groups (:mod:`train.loop.replica_loop`)
both run."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from train.core.files import write_json_atomic
from train.core.run import rundir
from train.data.order import eval_indices
from train.guards.divergence import Guard
from train.loop.components import Components
from train.models.losses import logits_of
from train.models.optim import grad_norm_and_clip
from train.observe.intervals import StepPhases
from train.observe.metrics import MetricsLogger


def gradient_sync(model: nn.Module, enabled: bool):
    """Skip the gradient all-reduce on non-final micro-steps (DDP no_sync; FSDP2 keeps
    unsharded gradients until the last one)."""
    if isinstance(model, DDP):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 module
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def train_step(c: Components, batches, phases: StepPhases) -> torch.Tensor:
    """Forward and backward over `accum` micro-batches; returns this rank's mean loss.
    ``phases`` times what does not wait for the other ranks (stragglers.py)."""
    total = None  # the micro-batches' losses, summed in float32
    for i in range(c.accum):
        x, y = phases.next_batch(batches)
        x = x.to(c.device, non_blocking=True)
        y = y.to(c.device, non_blocking=True)
        with gradient_sync(c.model, enabled=i == c.accum - 1):
            with c.autocast():
                loss = phases.forward(c.objective, c.model, x, y)[0]
                loss = loss / c.accum if c.accum > 1 else loss  # no op for a division by 1
            phases.backward(loss, c.scaler.scale(loss) if c.scaler else None)
        total = loss.detach().float() if total is None else total + loss.detach().float()
    return total


def optimizer_step(c: Components, guard: Guard, step: int) -> tuple[float, bool]:
    """Clip, check and apply the gradients: (gradient norm, whether the update was applied).
    The norm is computed every step: the divergence guard reads it before any update."""
    clip = c.cfg.optim.grad_clip
    if c.scaler:
        c.scaler.unscale_(c.optimizer)
    norm = grad_norm_and_clip(c.model, clip)
    applied = guard.gradients(step, norm)  # raises Diverged when the run must stop
    if c.scaler:  # it skips a non-finite step by itself and lowers its loss scale
        c.scaler.step(c.optimizer)
        c.scaler.update()
    elif applied:
        c.optimizer.step()
    c.scheduler.step()  # skipped or not, the schedule follows the step count
    c.optimizer.zero_grad(set_to_none=True)
    return norm, applied


@torch.no_grad()
def evaluate(c: Components, progress: Callable[[], None] = lambda: None) -> dict[str, float]:
    cfg, env = c.cfg, c.env
    total = min(len(c.data.val), cfg.train.eval_batches * cfg.train.global_batch_size)
    idx = eval_indices(len(c.data.val), cfg.train.eval_batches, cfg.train.global_batch_size,
                       env.rank, env.world_size)
    # Every rank runs the same number of forwards (FSDP gathers parameters in each one);
    # a rank whose share ran out evaluates sample 0 with weight 0.
    n_batches = math.ceil(math.ceil(total / env.world_size) / c.micro)
    classes = cfg.train.loss == "cross_entropy"  # accuracy means something only there
    c.module.eval()
    sums = torch.zeros(3, device=c.device)  # loss x n, correct, n
    for i in range(n_batches):
        chunk = idx[i * c.micro: (i + 1) * c.micro]
        x, y = c.data.val.__getitems__(chunk or [0])
        x, y = x.to(c.device), y.to(c.device)
        with c.autocast():
            loss, outputs = c.objective(c.module, x, y)
        if chunk:
            n = len(chunk)  # a loss is a mean over its batch: weight it by the samples
            sums[0] += loss * n
            if classes:
                sums[1] += (logits_of(outputs).argmax(-1) == y).float().mean() * n
            sums[2] += n
        progress()  # a batch evaluated: the hang watchdog's sign of progress
    c.module.train()
    if env.distributed:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    if sums[2] == 0:
        return {}
    out = {"val/loss": float(sums[0] / sums[2])}
    if classes:
        out["val/accuracy"] = float(sums[1] / sums[2])
    return out


def finish(c: Components, metrics: MetricsLogger | None, step: int,
           progress: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Final evaluation, result.json and the closing lines (also for a rerun of a run
    whose finish was interrupted); returns the evaluation, for the caller's close."""
    final = log_eval(c, metrics, step, progress)
    if c.env.leads_run:
        write_json_atomic(c.run_dir / rundir.RESULT, {"step": step, **final})
        metrics.summary(step, final)
    return final


def log_eval(c: Components, metrics: MetricsLogger | None, step: int,
             progress: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Collective: every rank evaluates its share; rank 0 logs the result."""
    if c.cfg.train.eval_batches == 0:
        return {}
    values = evaluate(c, progress)
    if c.env.leads_run and values:
        metrics.log_eval(step, values)
    return values
