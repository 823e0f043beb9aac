"""The divergence guard: a non-finite loss or gradient never reaches the weights, a
checkpoint or an export.

Every step's gradient norm is checked before the optimizer applies it. The norm is the
same on every rank (DDP's gradients are identical after their all-reduce; FSDP's
clip_grad_norm_ reduces over all shards), so every rank reaches the same verdict at
the same step without an extra collective; a rank whose loss is non-finite makes its
gradients non-finite too, and so everyone's after the all-reduce. At logging steps
the all-reduced loss is checked as well, and before each checkpoint the weights.

``train.nonfinite: stop`` (default) ends the run at the first such step with exit 4
(:class:`~train.core.errors.Diverged`) and one line naming the step, the value, the last
good checkpoint and what to try. ``skip_step`` drops that step's update instead, at
most ``train.max_skipped_steps`` times per run. With fp16, the gradient scaler skips
overflowing steps by design; only :data:`SCALER_SKIPS_IN_A_ROW` skips in a row (a
loss scale fallen by 2**20) count as divergence.

A run stopped this way leaves ``RUN_DIR/diverged.json``: torchrun restarts failed
workers whatever their exit code, and a restart of the same attempt would only diverge
again, so it exits 4 at once. A new run of the command (after changing the config)
starts fresh and removes the marker.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from train.core.errors import Diverged
from train.core.files import write_json_atomic
from train.core.run import rundir

log = logging.getLogger("train")

SCALER_SKIPS_IN_A_ROW = 20
MARKER = rundir.DIVERGED


class Guard:
    def __init__(self, *, mode: str, max_skips: int, scaled: bool, skipped: int,
                 run_dir: Path, last_good: Callable[[], Path | None],
                 grad_clip: float) -> None:
        self.mode, self.max_skips, self.scaled = mode, max_skips, scaled
        self.skipped = skipped          # updates skipped so far in this run (checkpointed)
        self.in_a_row = 0               # fp16: scaler skips in a row
        self.run_dir, self.last_good, self.grad_clip = run_dir, last_good, grad_clip

    def gradients(self, step: int, norm: float) -> bool:
        """Whether to apply this step's update; raises Diverged when the run must stop."""
        if math.isfinite(norm):
            self.in_a_row = 0
            return True
        if self.scaled:  # the grad scaler skips this update and lowers its scale
            self.in_a_row += 1
            if self.in_a_row >= SCALER_SKIPS_IN_A_ROW:
                raise self.diverged(step, f"the fp16 gradient scaler skipped {self.in_a_row} "
                                          "steps in a row (gradients stay non-finite)")
            return False
        if self.mode == "skip_step" and self.skipped < self.max_skips:
            self.skipped += 1
            log.warning("step %d: gradient norm %s; update skipped (%d of at most %d, "
                        "train.max_skipped_steps)", step, norm, self.skipped, self.max_skips)
            return False
        more = f" after {self.skipped} skipped step(s)" if self.mode == "skip_step" else ""
        raise self.diverged(step, f"gradient norm {norm}{more}")

    def loss(self, step: int, mean_loss: float, applied: bool) -> None:
        """The loss averaged over ranks at a logging step (the same on every rank)."""
        if applied and not math.isfinite(mean_loss):
            raise self.diverged(step, f"loss {mean_loss}")

    def weights(self, step: int, model: nn.Module, distributed: bool) -> None:
        """Before a checkpoint: every rank's parameters (its shards, under FSDP) finite."""
        finite = all(bool(torch.isfinite(_local(p)).all()) for p in model.parameters())
        if distributed:
            flag = torch.tensor([1.0 if finite else 0.0], device=_device(model))
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finite = bool(flag.item())
        if not finite:
            raise self.diverged(step, "the weights became non-finite")

    def diverged(self, step: int, what: str) -> Diverged:
        good = self.last_good()
        where = f"the last good checkpoint is {good}" if good else \
            "no checkpoint was saved yet (a rerun starts from step 0)"
        tries = ["a lower optim.lr", f"optim.grad_clip (now {self.grad_clip:g})"]
        if self.scaled:
            tries.append("precision=bf16 instead of fp16")
        if self.mode == "stop":
            tries.append("train.nonfinite=skip_step")
        message = (f"training diverged at step {step}: {what}; nothing non-finite was saved "
                   f"and {where}. Try {', '.join(tries[:-1])} or {tries[-1]}, then rerun the "
                   "same command to resume from there")
        return Diverged(message)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p  # FSDP2: this rank's shard


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def write_marker(run_dir: Path, step: int, message: str) -> None:
    write_json_atomic(run_dir / MARKER, {"step": step, "message": message})


def read_marker(run_dir: Path) -> str | None:
    try:
        return str(json.loads((run_dir / MARKER).read_text())["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_marker(run_dir: Path) -> None:
    (run_dir / MARKER).unlink(missing_ok=True)
