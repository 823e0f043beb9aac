"""The one collective of a logging step, and what rides on it.

Every logging step the ranks all-gather one row each: the loss, the step time, the data
and compute time (:class:`~train.observe.stragglers.StepPhases`), whether the rank was
told to stop, and rank 0's request for a link check. From these rows every rank gets the
mean loss and step time and the stop agreement, rank 0 judges the stragglers
(:mod:`train.observe.stragglers`) and watches the communication wait
(:mod:`train.observe.slowlinks`); a link check rank 0 asked for runs on every rank right
after the gather that carried the request. Nothing is added to an ordinary step.

The data metrics ride on it too (:func:`data_metrics`): ``data/wait_s``, the
slowest rank's wait for its batches per step (its micro-batches' waits summed, averaged
over the interval), and, for data read from object storage, ``data/fetched_bytes``: the
bytes every rank (with its DataLoader workers) fetched since this attempt started,
summed, which is what all the nodes fetched (one process of a node fetches an object for
the node's others).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import torch

from train.core.config import Config
from train.core.nodes.verdict import RankResult
from train.core.run.identity import WorkerIdentity
from train.distributed import ranks
from train.observe.slowlinks import LinkFinding, SlowLinks
from train.observe.stragglers import Finding, StepPhases, Stragglers


class Intervals:
    """The logging intervals of one rank: its step time and phase times since the last
    logging step, exchanged with every rank's in the one collective that averages the
    loss."""

    def __init__(self, cfg: Config, env: WorkerIdentity, device: torch.device, step: int,
                 model: torch.nn.Module,
                 preflight_links: dict[tuple[int, int], float] | None = None,
                 fetched: Callable[[], int] | None = None):
        """``fetched``: this rank's count of bytes fetched from object storage (None: the
        data is not read from there)."""
        self.env, self.device, self.fetched = env, device, fetched
        self.data: dict[str, float] = {}  # rank 0's data metrics of the last interval
        self.phases = StepPhases(device)
        self.last_time, self.last_step = time.perf_counter(), step
        ratio = cfg.logging.straggler_ratio
        layout = ranks.gather(env)(RankResult(
            rank=env.rank, node=env.node, host=socket.gethostname(),
            local_rank=env.local_rank)) if env.distributed and ratio > 0 else []
        self.judge = Stragglers(ratio, cfg.logging.straggler_steps, [r.host for r in layout])
        self.links = SlowLinks(ratio, cfg.logging.straggler_steps,
                               cfg.distributed.preflight_slow_ratio, env, layout, device,
                               preflight_links)
        if layout:
            self.phases.watch(model)

    def end(self, step: int, loss: torch.Tensor, stopping: bool = False
            ) -> tuple[float, float, list[Finding | LinkFinding], bool]:
        """Collective, at a logging step: (mean loss, mean step time, stragglers and slow
        links named or recovered: rank 0's, empty elsewhere, whether any rank is
        ``stopping``: the stop agreement rides on this gather)."""
        now, count = time.perf_counter(), step - self.last_step
        data_s, compute_s = self.phases.take()
        rows = ranks.gather_over_ranks(
            [loss, (now - self.last_time) / count, data_s / count, compute_s / count,
             float(stopping), self.links.flag(), *split_count(self.fetched)],
            self.device, self.env.distributed)
        findings: list[Finding | LinkFinding] = []
        if rows[0][5]:  # rank 0 asked: every rank saw it in this gather
            findings += self.links.check(step)
            now = time.perf_counter()  # the check is no part of the next interval
        self.last_time, self.last_step = now, step
        loss_value, step_time = ranks.mean_of(rows, 2)
        if self.env.is_main:
            self.data = data_metrics(rows, self.fetched is not None)
            findings = self.judge.observe(step, count, [(r[2], r[3]) for r in rows],
                                          step_time) + findings
            findings += self.links.observe(step, count, [(r[1], r[2], r[3]) for r in rows],
                                           step_time)
        return loss_value, step_time, findings, any(r[4] for r in rows)


def data_metrics(rows: list[list[float]], counting: bool) -> dict[str, float]:
    """An interval's data metrics from the gathered rows (the module's docstring says what
    they are); ``counting``: the rows carry fetched bytes."""
    out = {"data/wait_s": max(r[2] for r in rows)}
    if counting:
        out["data/fetched_bytes"] = sum(int(r[6]) * SPLIT + int(r[7]) for r in rows)
    return out


# A byte count rides the gather's float32 as two parts, each exact below 2**24: up to
# 2**48 bytes (256 TiB) per rank
SPLIT = 1 << 24


def split_count(count: Callable[[], int] | None) -> tuple[float, float]:
    """``count()`` as the two parts :func:`data_metrics` adds up again (0 without one)."""
    value = count() if count is not None else 0
    return float(value // SPLIT), float(value % SPLIT)
