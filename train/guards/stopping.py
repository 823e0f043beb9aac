"""Stopping cleanly: a signal becomes the same stop step on every rank (a step that
makes no progress: :mod:`train.guards.watchdog`); one during the run's end cuts that
end short (:mod:`train.guards.shutdown`).
"""

from __future__ import annotations

import logging
import math
import signal

import torch
import torch.distributed as dist

from train.core.run import failure_log
from train.guards.shutdown import SIGNALLED_S, Shutdown

log = logging.getLogger("train")


class StopFlag:
    """Set by SIGTERM/SIGINT; ranks agree on it so that all stop after the same step.

    The agreement is a reduction (MAX) of every rank's flag. Run every step it cost 10-30 %
    of a small model's step time on gloo (measured with bench/ddp_overhead.py): each one
    is a point where the faster rank waits for the slower. So it rides on the collective
    of each logging step (the loss and step times are gathered there anyway:
    :meth:`pace`), and a reduction of its own runs only when the last agreement is `every`
    steps old, sized from the step time all ranks share to AGREE_EVERY_S, and no logging
    step comes within as many steps (it agrees then: none at all when logging steps come
    that often, each 10th step of 0.1 s say). That one is started without waiting for it
    and read at the next such step (long done by then), so no rank waits for another
    there; a signal stops training within about two AGREE_EVERY_S (or two steps, when
    steps are longer; an agreement is skipped only for a logging step that decides
    sooner), well inside torchrun's ~30 s between SIGTERM and SIGKILL. Every rank counts
    the same steps, so all agree at the same ones, on the same values.
    """

    AGREE_EVERY_S = 0.5

    def __init__(self, shutdown: Shutdown | None = None, log_every: int = 0) -> None:
        """``log_every``: the steps between logging steps (logging.every_steps; 0: none
        to count on), whose gathers carry the flags."""
        self.requested = False
        self.log_every = log_every
        self.every = 1
        self.told: tuple[int, bool] = (-1, False)  # (step, any rank's flag) from a gather
        self.last_agreed = 0                        # the step of the last agreement
        self.pending: tuple[torch.Tensor, dist.Work] | None = None  # a reduction under way
        self.flag: torch.Tensor | None = None
        self.shutdown = shutdown

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.shutdown is not None and self.shutdown.begun:  # the checkpoint is written
            if not self.requested:
                log.warning("received %s during the run's end: ending within %.0f s", name,
                            SIGNALLED_S)
        elif not self.requested and not failure_log.kept_stop(
                f"received {name}: torchrun stops this rank, another process failed"):
            log.warning("received %s: stopping with a checkpoint", name)
        self.requested = True
        if self.shutdown is not None:
            self.shutdown.signalled()

    def pace(self, mean_step_time_s: float, step: int = -1, anyone: bool = False) -> None:
        """At a logging step, with what every rank's gather gave them all alike: the mean
        step time, and whether any rank had been asked to stop (``anyone``: the agreement
        of this ``step``, at no cost of its own)."""
        apart = self.AGREE_EVERY_S / max(mean_step_time_s, 1e-6)
        self.every = max(1, min(1000, math.ceil(apart)))
        self.told = (step, anyone)

    def agreed(self, step: int, device: torch.device, distributed: bool) -> bool:
        if not distributed:
            return self.requested
        if self.told[0] == step:  # this step's logging gather carried every rank's flag
            self.last_agreed = step
            return self.told[1]
        if step - self.last_agreed < self.every or self._gather_within_every(step):
            return False
        self.last_agreed = step
        if self._heard():  # what every rank's flag was at the previous agreement of its own
            return True
        if self.flag is None:  # one tensor for all: the last reduction was read above
            self.flag = torch.zeros(1, device=device)
        self.flag.fill_(1.0 if self.requested else 0.0)
        self.pending = self.flag, dist.all_reduce(self.flag, op=dist.ReduceOp.MAX,
                                                  async_op=True)
        return False

    def _gather_within_every(self, step: int) -> bool:
        return self.log_every > 0 and self.log_every - step % self.log_every < self.every

    def _heard(self) -> bool:
        if self.pending is None:
            return False
        flag, work = self.pending
        self.pending = None
        work.wait()
        return bool(flag.item())
